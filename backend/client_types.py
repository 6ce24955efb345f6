"""The client's types come from the server's OpenAPI document (this module sits above
``backend.main``: it builds the app to read it). ``render`` writes
``backend/client/resources.py`` (``TypedDict``s, standard library only) from the response
models the routes declare, so a REST shape is written once, as a pydantic model next to its
route. ``tests/backend/test_client_types.py`` fails when the file and the document part.

Regenerate after changing a response model::

    python -m backend.client_types          # rewrites backend/client/resources.py
    python -m backend.client_types --check  # exit 1 when it is stale
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

__all__ = ["CLIENT_TYPES", "EXTRA_FIELDS", "BASES", "render", "openapi_document", "RESOURCES"]

RESOURCES = Path(__file__).resolve().parent / "client" / "resources.py"

# The client's name for each shape: the OpenAPI schema it comes from and the schema's
# properties it leaves out (a request body's own fields, where a route answers with the body).
CLIENT_TYPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "PlacementBrief": ("PlacementBrief", ()),
    "Bound": ("BoundPublic", ()),
    "Mesh": ("MeshPublic", ()),
    "Replica": ("ReplicaPublic", ()),
    "CostModel": ("CostModelPublic", ()),
    "Job": ("JobPublic", ()),
    "Device": ("DeviceSample", ()),
    "Rank": ("RankPublic", ()),
    "MetricPoint": ("MetricPoint", ()),
    "MetricsPage": ("MetricsPublic", ()),
    "Forecast": ("ForecastPublic", ()),
    "FleetDevice": ("FleetDevice", ()),
    "FleetJob": ("FleetJobPublic", ()),
    "FleetTotals": ("FleetTotals", ()),
    "Fleet": ("FleetPublic", ()),
    "Summary": ("SummaryPublic", ()),
    "RankMemory": ("RankMemoryPublic", ()),
    "Memory": ("MemoryPublic", ()),
    "Cause": ("CausePublic", ()),
    "Causes": ("CausesPublic", ()),
    "Proposal": ("ProposalPublic", ()),
    "Effect": ("EffectPublic", ()),
    "Placement": ("PlacementPublic", ()),
    # GET/PUT .../overrides answer the overrides in force: the body's shape without its reason.
    "Overrides": ("OverridesIn", ("reason",)),
    "OverridesSet": ("OverridesIn", ("reason",)),
    "AuditRecord": ("AuditPublic", ()),
    "Token": ("TokenPublic", ()),
    "TokenCreated": ("TokenCreated", ()),
    "Health": ("HealthPublic", ()),
    "WhoAmI": ("WhoAmIPublic", ()),
}
# Fields a route adds to a schema's (PUT .../overrides: the proposal that respects them).
EXTRA_FIELDS: dict[str, dict[str, str]] = {"OverridesSet": {"proposal_id": "int | None"}}
# A type that is another with more keys is written as its subclass (render checks the base's
# keys and types are all in it, the same).
BASES: dict[str, str] = {"TokenCreated": "Token", "OverridesSet": "Overrides"}

_SCALARS = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "None"}


def _type(schema: dict[str, Any], names: dict[str, str]) -> str:
    """The Python annotation for one JSON schema (as pydantic writes them)."""
    if "$ref" in schema:
        return names.get(schema["$ref"].rsplit("/", 1)[-1], "dict[str, Any]")
    if "anyOf" in schema:
        return " | ".join(dict.fromkeys(_type(s, names) for s in schema["anyOf"]))
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        return "Literal[" + ", ".join(json.dumps(v) for v in values) + "]"
    kind = schema.get("type")
    if kind == "array":
        return f"list[{_type(schema.get('items', {}), names)}]"
    if kind == "object":
        extra = schema.get("additionalProperties")
        return f"dict[str, {_type(extra, names)}]" if isinstance(extra, dict) else "dict[str, Any]"
    return _SCALARS.get(kind, "Any") if isinstance(kind, str) else "Any"


def render(document: dict[str, Any]) -> str:
    """The text of ``backend/client/resources.py`` for this OpenAPI document: one
    ``TypedDict`` a shape, its keys in alphabetical order (the document's descriptions as
    comments); ``total=False`` where the document does not require every key."""
    schemas = document["components"]["schemas"]
    names = {schema: ours for ours, (schema, _) in reversed(CLIENT_TYPES.items())}
    out = [
        '"""The server\'s JSON answers, typed for readers and mypy: GENERATED from the OpenAPI',
        "document by ``python -m backend.client_types`` (do not edit: change the route's",
        "response model and regenerate). Each type is named as the client calls it.",
        "",
        "One module, over 400 lines on purpose: generated, one ``TypedDict`` a REST shape, as",
        '``backend.client`` exports them."""',
        "",
        "from __future__ import annotations",
        "",
        "from typing import Any, Literal, TypedDict",
        "",
        "__all__ = [",
        *textwrap.wrap(", ".join(f'"{n}"' for n in CLIENT_TYPES) + ",", 96,
                       initial_indent="    ", subsequent_indent="    "),
        "]",
    ]
    emitted: dict[str, dict[str, tuple[str, str]]] = {}
    for ours, (schema_name, left_out) in CLIENT_TYPES.items():
        schema = schemas[schema_name]
        props = {k: v for k, v in schema["properties"].items() if k not in left_out}
        required = set(schema.get("required", ()))
        total = set(props) <= required and ours not in EXTRA_FIELDS
        fields = {k: (_type(v, names), v.get("description", "")) for k, v in props.items()}
        fields.update({k: (t, "") for k, t in EXTRA_FIELDS.get(ours, {}).items()})
        emitted[ours] = dict(fields)
        base = BASES.get(ours)
        if base is not None:
            inherited = emitted[base]
            if any(fields.get(k, ("",))[0] != t for k, (t, _) in inherited.items()):
                raise ValueError(f"{ours} is not {base} with more keys: write it without a base.")
            fields = {k: v for k, v in fields.items() if k not in inherited}
        parents = base or "TypedDict"
        doc = f"``{schema_name}``" + (f": {_first_line(schema['description'])}" if schema.get("description") else ".")
        if left_out or ours in EXTRA_FIELDS:  # not the schema itself: say how it differs
            doc = f"``{schema_name}`` without {', '.join(left_out)}" + "".join(
                f", with {k}" for k in EXTRA_FIELDS.get(ours, {})) + "."
        out += ["", "", f"class {ours}({parents}{'' if total else ', total=False'}):",
                *textwrap.wrap(f'"""{doc}"""', 96, initial_indent="    ", subsequent_indent="    "), ""]
        for key in sorted(fields):
            kind, text = fields[key]
            line = f"    {key}: {kind}"
            out.append(f"{line}  # {_first_line(text)}" if text else line)
    return "\n".join(out) + "\n"


def _first_line(text: str) -> str:
    return " ".join(text.split("\n\n", 1)[0].split())


def openapi_document() -> dict[str, Any]:
    """The document the server serves (an app on a throwaway SQLite file, no worker process)."""
    from backend.main import create_app
    from backend.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        app = create_app(Settings(db=f"sqlite:///{tmp}/openapi.db", policy_process=False))
        return app.openapi()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when backend/client/resources.py is stale")
    args = ap.parse_args(argv)
    text = render(openapi_document())
    if args.check:
        if RESOURCES.read_text() != text:
            print(f"{RESOURCES} is stale: run python -m backend.client_types", file=sys.stderr)
            return 1
        return 0
    RESOURCES.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

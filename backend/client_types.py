"""The client's types come from the server's OpenAPI document (this module sits above
``backend.main``: it builds the app to read it). ``render`` writes
``backend/client/resources.py`` (``TypedDict``s, standard library only): one type for every
schema a route answers with, named without its ``Public`` suffix, so a REST shape is written
once, as the pydantic response model next to its route, and a new one reaches the client
when the file is regenerated. ``tests/backend/test_client_types.py`` fails when the file and
the document part.

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

__all__ = ["client_types", "RENAMES", "DERIVED", "EXTRA_FIELDS", "BASES", "render", "openapi_document", "RESOURCES"]

RESOURCES = Path(__file__).resolve().parent / "client" / "resources.py"

# Every schema a route answers with (and every schema those name) becomes a client type,
# named as the schema less its "Public" suffix, except where the client's name came first.
RENAMES: dict[str, str] = {"DeviceSample": "Device", "MetricsPublic": "MetricsPage", "AuditPublic": "AuditRecord"}
# Types the routes answer without a model of their own: (name, schema, properties left out).
# GET/PUT .../overrides answer the overrides in force, the PUT body's shape without its reason.
DERIVED: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Overrides", "OverridesIn", ("reason",)),
    ("OverridesSet", "OverridesIn", ("reason",)),
)
# Fields a route adds to a schema's (PUT .../overrides: the proposal that respects them).
EXTRA_FIELDS: dict[str, dict[str, str]] = {"OverridesSet": {"proposal_id": "int | None"}}
# A type that is another with more keys is written as its subclass (render checks the base's
# keys and types are all in it, the same).
BASES: dict[str, str] = {"TokenCreated": "Token", "OverridesSet": "Overrides", "Pipeline": "PipelineBrief"}


def client_types(document: dict[str, Any]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """{client name: (schema, properties left out)} for every schema a 2xx JSON answer
    reaches, and the DERIVED ones."""
    schemas = document["components"]["schemas"]
    todo = [op for ops in document.get("paths", {}).values() for op in ops.values()]
    seen: set[str] = set()
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
                name = ref.rsplit("/", 1)[-1]
                if name not in seen:
                    seen.add(name)
                    todo.append(schemas[name])
            todo += [v for k, v in node.items() if k not in ("parameters", "requestBody")
                     and not (k.isdigit() and not k.startswith("2"))]
        elif isinstance(node, list):
            todo += node
    found: dict[str, tuple[str, tuple[str, ...]]] = {RENAMES.get(n, n.removesuffix("Public")): (n, ()) for n in seen}
    found.update({name: (schema, left_out) for name, schema, left_out in DERIVED})
    return dict(sorted(found.items()))


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
    types = client_types(document)
    names = {schema: ours for ours, (schema, left_out) in types.items() if not left_out}
    order = list(types)
    for ours in list(order):  # a base before its subclasses
        base = BASES.get(ours)
        if base in types and order.index(base) > order.index(ours):
            order.remove(ours)
            order.insert(order.index(base) + 1, ours)
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
        *textwrap.wrap(", ".join(f'"{n}"' for n in types) + ",", 96,
                       initial_indent="    ", subsequent_indent="    "),
        "]",
    ]
    emitted: dict[str, dict[str, tuple[str, str]]] = {}
    for ours in order:
        schema_name, left_out = types[ours]
        schema = schemas[schema_name]
        props = {k: v for k, v in schema["properties"].items() if k not in left_out}
        required = set(schema.get("required", ()))
        total = set(props) <= required and ours not in EXTRA_FIELDS
        fields = {k: (_type(v, names), v.get("description", "")) for k, v in props.items()}
        fields.update({k: (t, "") for k, t in EXTRA_FIELDS.get(ours, {}).items()})
        emitted[ours] = dict(fields)
        base = BASES.get(ours) if BASES.get(ours) in types else None
        if base is not None:
            inherited = emitted[base]
            if any(fields.get(k, ("",))[0] != t for k, (t, _) in inherited.items()):
                raise ValueError(f"{ours} is not {base} with more keys: write it without a base.")
            fields = {k: v for k, v in fields.items() if k not in inherited}
        doc = f"``{schema_name}``" + (f": {_first_line(schema['description'])}" if schema.get("description") else ".")
        if left_out or ours in EXTRA_FIELDS:  # not the schema itself: say how it differs
            doc = f"``{schema_name}`` without {', '.join(left_out)}" + "".join(
                f", with {k}" for k in EXTRA_FIELDS.get(ours, {})) + "."
        out += ["", "", f"class {ours}({base or 'TypedDict'}{'' if total else ', total=False'}):",
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

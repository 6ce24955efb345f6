"""The client's types are the server's response models: backend/client/resources.py is
what ``backend.client_types`` renders from the OpenAPI document, to the byte."""

from __future__ import annotations

import copy
import typing

from fastapi import APIRouter

from backend.api.routes import identity, jobs, pages
from backend.client import resources
from backend.client_types import RESOURCES, client_types, openapi_document, render


def test_the_client_types_are_rendered_from_the_openapi_document():
    doc = openapi_document()
    assert RESOURCES.read_text() == render(doc), "stale: run python -m backend.client_types"
    types = client_types(doc)
    assert {"Job", "Rank", "Device", "Forecast", "WhoAmI", "Fleet", "Proposal", "TokenCreated"} <= set(types)
    assert "ErrorPublic" not in {schema for schema, _ in types.values()}  # error answers are not types
    for ours, (schema, left_out) in types.items():  # every exported type, every field
        keys = set(typing.get_type_hints(getattr(resources, ours)))
        assert set(doc["components"]["schemas"][schema]["properties"]) - set(left_out) <= keys, ours


def test_a_changed_response_model_changes_the_client_types():
    doc = openapi_document()
    changed = copy.deepcopy(doc)
    changed["components"]["schemas"]["MetricPoint"]["properties"]["step_ms"] = {"type": "integer"}
    del changed["components"]["schemas"]["RankPublic"]["properties"]["gc_ms"]
    before, after = render(doc), render(changed)

    def fields(text: str, cls: str) -> dict[str, str]:
        body = text.split(f"\nclass {cls}(")[1].split("\nclass ")[0]
        return {k.strip(): v.split("  #")[0].strip() for k, v in
                (line.split(":", 1) for line in body.splitlines()[1:] if line.startswith("    ") and ":" in line
                 and not line.strip().startswith('"'))}

    assert fields(before, "MetricPoint")["step_ms"] == "float" and fields(after, "MetricPoint")["step_ms"] == "int"
    assert "gc_ms" in fields(before, "Rank") and "gc_ms" not in fields(after, "Rank")
    # A new response model is a new client type, named without its Public suffix.
    changed["components"]["schemas"]["GaugePublic"] = {"type": "object", "required": ["v"],
                                                       "properties": {"v": {"type": "number"}}}
    changed["paths"]["/api/v1/gauge"] = {"get": {"responses": {"200": {"content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/GaugePublic"}}}}}}}
    assert fields(render(changed), "Gauge") == {"v": "float"}


def test_forecast_and_whoami_live_with_their_resources():
    def paths(router: APIRouter) -> set[str]:
        return {getattr(r, "path", "") for r in router.routes}

    assert "/api/v1/jobs/{job}/forecast" in paths(jobs.router)
    assert "/api/v1/whoami" in paths(identity.router)
    assert not [p for p in paths(pages.router) if p.startswith("/api/")]


def test_eta_seconds_is_the_forecasts_and_the_old_names_are_deprecated():
    schemas = openapi_document()["components"]["schemas"]
    forecast, job = schemas["ForecastPublic"]["properties"], schemas["JobPublic"]["properties"]
    assert "deprecated" not in forecast["eta_seconds"]
    assert forecast["eta_s"]["deprecated"] is True and job["eta_s"]["deprecated"] is True

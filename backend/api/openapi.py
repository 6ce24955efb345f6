"""The OpenAPI document says what the server really answers, and 405s name every method.

Every ``/api/`` operation names the bearer scheme (``bearerAuth``), so ``/docs`` can authorize.

FastAPI documents each operation's success and its 422; the server also answers 401 and 403
(tokens and roles), 400, 404 and 409 (the controller's refusals: ``ControlError``), 503 (the
database does not take writes) and, for anything unexpected, 500. Every one of those is
``{"detail": "<one sentence>"}``, a 422 too (``backend.api.errors``: the first problem
pydantic found, as a sentence).

A path served by several routes (GET and PUT on ``/policy``) answered an unsupported method
(OPTIONS, PATCH) with the first route's methods in ``Allow``; ``allow_all_methods`` puts
every method the path supports there.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

__all__ = ["install_openapi"]

ERROR_SCHEMA = "ErrorPublic"
BEARER = "bearerAuth"
_ERRORS: dict[str, str] = {
    "400": "Refused: the request contradicts the job's state or rules (one sentence says why).",
    "401": "Missing or invalid bearer token.",
    "403": "The token's role may not do this.",
    "404": "No such job, proposal, placement or token.",
    "409": "Conflicts with the job's current state (for example a proposal no longer pending).",
    "500": "The backend failed; the traceback is in its log.",
    "503": "The database does not take writes now; nothing was changed (see /healthz).",
}


def _document_errors(schema: dict[str, Any]) -> dict[str, Any]:
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    comps[ERROR_SCHEMA] = {
        "title": ERROR_SCHEMA, "type": "object", "required": ["detail"],
        "properties": {"detail": {"type": "string", "title": "Detail"}},
    }
    if "HTTPValidationError" in comps:
        comps["HTTPValidationError"]["properties"]["detail"] = {"title": "Detail", "type": "string"}
    # Every /api/ call takes a bearer token (the routes read the Authorization header
    # themselves): declared here, /docs gets its Authorize button and sends the token.
    schema["components"].setdefault("securitySchemes", {})[BEARER] = {
        "type": "http", "scheme": "bearer",
        "description": "A Rebalancer token (`rebalancer token create`, or the admin token)."}
    ref = {"application/json": {"schema": {"$ref": f"#/components/schemas/{ERROR_SCHEMA}"}}}
    for path, ops in schema.get("paths", {}).items():
        if not path.startswith("/api/"):
            continue
        for op in ops.values():
            op.setdefault("security", [{BEARER: []}])
            responses = op.setdefault("responses", {})
            for code, text in _ERRORS.items():
                responses.setdefault(code, {"description": text, "content": ref})
    return schema


# No string a request carries may hold NUL (PostgreSQL's text cannot store it): the edge refuses
# one with 422 (backend.api.edge), and the document says so on every string and free key a
# request may carry, so a client (or a fuzzer) that follows the document never meets that 422.
NUL_FREE = "^[^\\x00]*$"


def _nul_free(node: Any, comps: dict[str, Any], seen: set[str]) -> None:
    """Add ``NUL_FREE`` to every string schema (without enum or pattern of its own) and every
    object with free keys under ``node``, following ``$ref``s into ``comps`` once each."""
    if isinstance(node, list):
        for item in node:
            _nul_free(item, comps, seen)
        return
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
        name = ref.rsplit("/", 1)[1]
        if name not in seen and name in comps:
            seen.add(name)
            _nul_free(comps[name], comps, seen)
    if node.get("type") == "string" and "enum" not in node and "const" not in node and "pattern" not in node:
        node["pattern"] = NUL_FREE
    if node.get("type") == "object" and node.get("additionalProperties", True) is not False \
            and "propertyNames" not in node:
        node["propertyNames"] = {"pattern": NUL_FREE}
    for key, value in node.items():
        if key not in ("$ref", "enum", "const", "default", "examples", "example"):
            _nul_free(value, comps, seen)


def _document_nul(schema: dict[str, Any]) -> dict[str, Any]:
    comps = schema.get("components", {}).get("schemas", {})
    seen: set[str] = set()
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            for param in op.get("parameters", ()):
                _nul_free(param.get("schema"), comps, seen)
            _nul_free(op.get("requestBody"), comps, seen)
    return schema


def install_openapi(app: FastAPI) -> None:
    """Document the error answers in ``/openapi.json`` and fill ``Allow`` on every 405."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document_nul(_document_errors(get_openapi(
                title=app.title, version=app.version, summary=app.summary,
                description=app.description, routes=app.routes)))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    paths: list[tuple[re.Pattern[str], str]] = []

    def allowed_methods(path: str) -> str:
        if not paths:
            for template, ops in openapi().get("paths", {}).items():
                methods = ", ".join(sorted(m.upper() for m in ops))
                paths.append((re.compile("^" + re.sub(r"\\{[^/]+\\}", "[^/]+", re.escape(template)) + "$"),
                              methods))
        return "; ".join(m for rx, m in paths if rx.match(path)).replace("; ", ", ")

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 405:
            allowed = allowed_methods(request.url.path)
            if allowed:
                exc.headers = {**(exc.headers or {}), "Allow": allowed}
        return await http_exception_handler(request, exc)  # FastAPI's own, otherwise

    app.add_exception_handler(StarletteHTTPException, method_not_allowed)

"""The app's two error handlers: ``ControlError`` (the controller's one-sentence refusals,
with their status code) and request validation (pydantic), each answered as
``{"detail": "<one sentence>"}``.

A validation error names the field and what it must be, from the first problem pydantic
found (the constraints live in the request models' ``Field``s).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from backend.control.errors import ControlError

__all__ = ["install_error_handlers", "validation_sentence"]


def validation_sentence(exc: RequestValidationError) -> str:
    """One sentence for the first error: ``<field>: <pydantic's message>.``"""
    errors = exc.errors()
    if not errors:
        return "Invalid request."
    err = errors[0]
    msg = str(err.get("msg", "invalid value"))
    if err.get("type") == "policy":  # models that phrase their own sentence (control/models.py)
        return msg
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
    ctx = err.get("ctx") or {}
    if "error" in ctx and msg.startswith("Value error, "):
        msg = str(ctx["error"])
    text = f"{'.'.join(loc)}: {msg}" if loc else msg
    return text if text.endswith(".") else text + "."


def install_error_handlers(app: FastAPI) -> None:
    async def control_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ControlError)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)

    async def validation_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return JSONResponse({"detail": validation_sentence(exc)}, status_code=422)

    app.add_exception_handler(ControlError, control_error)
    app.add_exception_handler(RequestValidationError, validation_error)

"""The app's error handlers: ``ControlError`` (the controller's one-sentence refusals,
with their status code), request validation (pydantic), a database fault (503 with the
reason and ``Retry-After``: read-only, unreachable, file gone; nothing was changed) and any
other failure (500, traceback in the log), each answered as ``{"detail": "<one sentence>"}``:
never plain text.

A validation error names the field and what it must be, from the first problem pydantic
found (the constraints live in the request models' ``Field``s).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError

from backend.api.edge import NUL_SENTENCE
from backend.api.forwarding import answer_elsewhere
from backend.control.errors import ControlError, ElsewhereError
from backend.storage.health import report_fault
from backend.storage.writes import database_fault, one_line

__all__ = ["install_error_handlers", "validation_sentence"]

log = logging.getLogger("rebalancer.api")


def validation_sentence(exc: RequestValidationError) -> str:
    """The first error as ``<where>.<field>: <pydantic's message>`` (the form the client
    used to build from FastAPI's list), or a model's own sentence (``control/models.py``)."""
    errors = exc.errors()
    if not errors:
        return "Invalid request."
    err = errors[0]
    msg = str(err.get("msg", "invalid value"))
    if err.get("type") == "policy":  # models that phrase their own sentence
        return msg
    loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    return f"{loc}: {msg}" if loc else msg


def install_error_handlers(app: FastAPI) -> None:
    async def control_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ControlError)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)

    async def validation_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return JSONResponse({"detail": validation_sentence(exc)}, status_code=422)

    app.add_exception_handler(ControlError, control_error)
    app.add_exception_handler(ElsewhereError, answer_elsewhere)  # forwarded to the job's owner
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(DBAPIError, _database_error)
    app.add_exception_handler(Exception, _internal_error)


# PostgreSQL's text cannot hold NUL: the edge refuses a request carrying one (backend.api.edge);
# one that reaches SQL some other way is refused there, before anything is written.


def _nul_in_text(exc: DBAPIError) -> bool:
    return isinstance(exc, DataError) and "cannot contain NUL" in str(exc.orig)


async def _database_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DBAPIError)
    if _nul_in_text(exc):
        return JSONResponse({"detail": NUL_SENTENCE}, status_code=422)
    if not database_fault(exc):
        return await _internal_error(request, exc)
    report_fault(log, f"{request.method} {request.url.path}", exc)
    return JSONResponse(
        {"detail": f"The database does not take writes now ({one_line(exc, 200)}); nothing was "
                   f"changed. Try again when /healthz says ok."},
        status_code=503, headers={"Retry-After": "5"})


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return JSONResponse({"detail": "The backend failed to handle this request; see its log."},
                        status_code=500)

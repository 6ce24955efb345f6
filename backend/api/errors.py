"""Error handlers: every REST error is JSON with a ``detail`` sentence, never plain text.

A database fault (read-only, unreachable, file gone) answers 503 with the reason and a
``Retry-After``; the change was not made. Anything else unexpected answers 500 with a
sentence pointing at the log (where the traceback goes).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError

from backend.storage.health import report_fault
from backend.storage.writes import database_fault, one_line

__all__ = ["install_error_handlers"]

log = logging.getLogger("rebalancer.api")


async def _database_error(request: Request, exc: Exception) -> JSONResponse:
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


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(DBAPIError, _database_error)
    app.add_exception_handler(Exception, _internal_error)

"""``GET /healthz``: liveness and a database round trip."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.orm import Session

from backend.api.deps import PartsDep

__all__ = ["router", "HealthPublic"]

router = APIRouter(tags=["health"])


class HealthPublic(BaseModel):
    status: str  # "ok" or "degraded"
    database: str  # "ok" or the error
    open_mode: bool  # True while anyone may act as admin (loopback, no tokens)
    jobs: int  # jobs in live state
    hook_connections: int


@router.get("/healthz", response_model=HealthPublic)
async def healthz(parts: PartsDep) -> JSONResponse:
    """200 when the backend and its database answer, 503 otherwise (no auth needed)."""

    def ping(s: Session) -> str:
        s.execute(text("SELECT 1"))
        return "ok"

    try:
        database = await parts.sql.run(ping)
    except Exception as exc:  # report, do not crash: the probe must always answer
        database = f"{type(exc).__name__}: {exc}"[:300]
    try:
        open_mode = await parts.sql.run(lambda _s: parts.auth.open_mode)
    except Exception:
        open_mode = False
    body = HealthPublic(
        status="ok" if database == "ok" else "degraded", database=database, open_mode=open_mode,
        jobs=len(parts.live.jobs()), hook_connections=parts.connections.count(),
    )
    return JSONResponse(body.model_dump(), status_code=200 if database == "ok" else 503)

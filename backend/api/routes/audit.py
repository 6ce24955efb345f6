"""``GET /api/v1/audit``: the whole audit log (admin), including actions outside any job
such as token creation. Per-job records are also at ``/api/v1/jobs/{job}/audit``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query

from backend.api.deps import AdminDep, SqlDep
from backend.api.routes.control import AuditsPublic
from backend.storage import control as db

__all__ = ["router"]

router = APIRouter(prefix="/api/v1", tags=["control"])


@router.get("/audit", response_model=AuditsPublic)
async def list_all_audit(
    actor: AdminDep, sql: SqlDep,
    job: str | None = Query(default=None, description="only this job's records"),
    action: str | None = Query(default=None, description="only this action, e.g. proposal.approve"),
    limit: int = Query(default=200, ge=1, le=5000),
) -> dict[str, Any]:
    """Audit records of every job and of the backend itself, newest first."""

    rows = await sql.run(lambda s: [r.public() for r in db.list_audit(s, job, action=action, limit=limit)])
    return {"data": rows, "count": len(rows)}

"""``GET /healthz``: liveness and whether the database takes writes (``StorageHealth``)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from backend.api.deps import PartsDep
from backend.parts import Parts

__all__ = ["router", "HealthPublic"]

router = APIRouter(tags=["health"])


class HealthPublic(BaseModel):
    status: str = Field(description='"ok", or "degraded" while the database does not take writes')
    database: str = Field(description='"ok", or why not (one sentence)')
    open_mode: bool  # True while anyone may act as admin (loopback, no tokens)
    jobs: int  # jobs in live state
    hook_connections: int = Field(description="ranks with an open hook websocket")
    hook_sockets: int = Field(default=0, description="open hook websockets (a node connection carries "
                              "the ranks of one node: it counts once)")
    buffered_windows: int = Field(description="metric windows waiting in memory for the database")
    dropped_windows: int = Field(description="metric windows dropped since start (refused rows, full buffer)")
    jobs_owned: int = Field(default=0, description="jobs this replica controls: with several replicas, the "
                            "jobs whose lease it holds (0 while Redis is down); with one, every live job")
    replica_id: str = Field(default="", description='this replica\'s id with several replicas; "" with one')
    cluster: str = Field(default="off", description='"off" (one replica), "ok", or "paused: <why>" '
                         "while Redis is unreachable (control pauses; ingest, dashboards and training go on)")


@router.get("/healthz", response_model=HealthPublic,
            responses={503: {"model": HealthPublic, "description": "Degraded: the database does "
                             "not take writes; live ingest and the dashboard go on from memory."}})
async def healthz(parts: PartsDep) -> JSONResponse:
    """200 when the backend and its database take writes, 503 (``degraded``, with the reason)
    otherwise (no auth needed)."""
    problem = await parts.sql.run(lambda _s: parts.storage.check())
    problem = problem or parts.writes.fault and f"persisting metrics fails: {parts.writes.fault}"
    try:
        open_mode = await parts.sql.run(lambda _s: parts.auth.open_mode)
    except Exception:
        open_mode = False
    body = HealthPublic(
        status="degraded" if problem else "ok", database=problem or "ok", open_mode=open_mode,
        jobs=len(parts.live.jobs()), hook_connections=parts.connections.count(),
        hook_sockets=parts.connections.sockets(),
        buffered_windows=len(parts.writes), dropped_windows=parts.writes.dropped_total,
        cluster=_cluster_state(parts),
        jobs_owned=len(parts.live.jobs()) if parts.cluster is None else parts.cluster.status().owned_jobs,
        replica_id="" if parts.cluster is None else parts.cluster.replica_id,
    )
    return JSONResponse(body.model_dump(), status_code=503 if problem else 200)


def _cluster_state(parts: Parts) -> str:
    if parts.cluster is None:
        return "off"
    status = parts.cluster.status()
    return "ok" if status.state == "ok" else f"paused: {status.reason}"

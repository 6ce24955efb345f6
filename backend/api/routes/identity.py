"""Who the caller is: ``GET /api/v1/whoami`` (any valid token; the pages show operator
controls from it, scripts check a token with it)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from backend.api.deps import AuthDep, SqlDep, ViewerDep
from backend.auth.access import allows

__all__ = ["router", "WhoAmIPublic"]

router = APIRouter(prefix="/api/v1", tags=["auth"])


class WhoAmIPublic(BaseModel):
    name: str = Field(description="The token's name (the audit log's actor).")
    role: str = Field(description="viewer, operator, admin or hook.")
    operator: bool = Field(description="Whether the role may take operator actions (approve, mode, ...).")
    open_mode: bool = Field(description="True while the server is on loopback with no active token: every caller is admin.")


@router.get("/whoami", response_model=WhoAmIPublic, summary="Who the token belongs to")
async def whoami_route(actor: ViewerDep, auth: AuthDep, sql: SqlDep) -> WhoAmIPublic:  # operationId kept
    """Who the bearer token belongs to; the page shows operator controls from ``role``."""
    open_mode = await sql.run(lambda _s: bool(auth.open_mode))
    return WhoAmIPublic(name=actor.name, role=actor.role, operator=allows(actor, "operator"), open_mode=open_mode)

"""Token management (admin role): create (secret shown once), list, revoke."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from backend.api.deps import AdminDep, AuthDep, RowId, SocketsDep, SqlDep
from backend.auth.tokens import (
    TokenRow,
    create_token,
    is_last_admin,
    list_tokens,
    revoke_token,
)
from backend.control.records import audit_token
from rebalancer_wire.protocol import JOB_NAME_PATTERN, ProtocolError

__all__ = ["router", "TokenCreate", "TokenPublic", "TokenCreated", "TokensPublic"]

log = logging.getLogger("rebalancer.api")
LAST_ADMIN = ("This is the last admin token: revoking it would leave nobody to administer the "
              "backend. Create another admin token first (POST /api/v1/tokens with role admin), "
              "then revoke this one.")
router = APIRouter(prefix="/api/v1/tokens", tags=["tokens"])


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not ignored
    role: Literal["viewer", "operator", "admin", "hook"]
    name: str = Field("", max_length=128)
    job: str | None = Field(None, min_length=1, max_length=128,
                            description="Required for hook tokens (400 without), refused "
                            "otherwise (400); a name the hook protocol accepts.",
                            json_schema_extra={"pattern": JOB_NAME_PATTERN})
    reason: str = Field("", max_length=2048)


class TokenPublic(BaseModel):
    id: int
    name: str
    role: str
    job: str | None
    hint: str  # the secret's first characters
    created_at: float
    created_by: str
    revoked_at: float | None


class TokenCreated(TokenPublic):
    secret: str  # shown once; only its hash is stored


class TokensPublic(BaseModel):
    data: list[TokenPublic]
    count: int


def _public(row: TokenRow) -> dict[str, Any]:
    return {
        "id": row.id, "name": row.name, "role": row.role, "job": row.job, "hint": row.hint,
        "created_at": row.created_at, "created_by": row.created_by,
        "revoked_at": row.revoked_at,
    }


@router.post("", response_model=TokenCreated, status_code=201, summary="Create a token")
async def create(body: TokenCreate, actor: AdminDep, auth: AuthDep, sql: SqlDep) -> TokenCreated:
    def run(s: Session) -> TokenCreated:
        row, secret = create_token(s, role=body.role, name=body.name.strip(), job=body.job or None,
                                   created_by=actor.name)
        audit_token(s, "token.create", {"id": row.id, "name": row.name, "role": row.role, "job": row.job},
                    actor=actor, reason=body.reason)
        s.commit()
        return TokenCreated(**_public(row), secret=secret)

    try:
        created = await sql.run(run)
    except ProtocolError as exc:  # a job name no hook may use
        raise HTTPException(422, str(exc)) from None
    except ValueError as exc:  # role and job do not go together: a rule across fields
        raise HTTPException(400, str(exc).replace(" pass --job NAME.", " give its job name.")) from None
    auth.invalidate()
    return created


@router.get("", response_model=TokensPublic, summary="List tokens")
async def list_all(
    _actor: AdminDep, sql: SqlDep,
    include_revoked: Annotated[bool, Query(description="Also list revoked tokens.")] = False,
) -> TokensPublic:
    def run(s: Session) -> TokensPublic:
        rows = [TokenPublic(**_public(r)) for r in list_tokens(s, include_revoked=include_revoked)]
        return TokensPublic(data=rows, count=len(rows))

    return await sql.run(run)


@router.delete("/{token_id}", response_model=TokenPublic, summary="Revoke a token",
               responses={409: {"description": "The last admin token: create another admin token first."}})
async def revoke(
    token_id: RowId, actor: AdminDep, auth: AuthDep, sockets: SocketsDep, sql: SqlDep,
    reason: Annotated[str, Query(max_length=2048)] = "",
) -> TokenPublic:
    def run(s: Session) -> TokenPublic | None:
        existing = s.get(TokenRow, token_id)
        if existing is not None and is_last_admin(s, existing):
            raise HTTPException(409, LAST_ADMIN)
        row = revoke_token(s, token_id)
        if row is None:
            return None
        audit_token(s, "token.revoke", {"id": row.id, "name": row.name, "role": row.role},
                    actor=actor, reason=reason)
        s.commit()
        return TokenPublic(**_public(row))

    found = await sql.run(run)
    if found is None:
        raise HTTPException(404, f"Token {token_id} not found.")
    auth.invalidate()
    await sockets.close_token(token_id)  # its open hook and dashboard sockets
    return found

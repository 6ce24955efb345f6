"""The ``auth_tokens`` table: a bearer token's hashed secret, role, job scope and history.
What a token may do is ``backend.auth``'s; storage only keeps the rows."""

from __future__ import annotations

import time

from sqlalchemy import Float, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from backend.storage.base import Base

__all__ = ["TokenRow"]


class TokenRow(Base):
    __tablename__ = "auth_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    job: Mapped[str | None] = mapped_column(String(128), nullable=True)
    secret_sha256: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    hint: Mapped[str] = mapped_column(String(16))  # first characters, to tell tokens apart
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    created_by: Mapped[str] = mapped_column(String(128), default="")
    revoked_at: Mapped[float | None]

"""Bearer tokens and roles.

Roles, from least to most: ``viewer`` (read), ``operator`` (approve, reject, override, mode,
rollback), ``admin`` (policy, tokens, everything). ``hook`` tokens are scoped to one job and
may only speak on ``/ws/hook`` for that job. Secrets are random 32-byte strings shown once;
only their SHA-256 is stored.

Open mode: while no active token exists and the server is bound to loopback, every caller
is an admin named ``anonymous`` (the log says so at start). ``rebalancer serve`` refuses a
non-loopback address with no tokens.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from backend.storage.tokens import TokenRow
from rebalancer_wire.protocol import check_job_name

__all__ = [
    "ROLES",
    "ROLE_LEVEL",
    "Actor",
    "TokenRow",
    "AuthService",
    "hash_secret",
    "role_allows",
    "create_token",
    "list_tokens",
    "revoke_token",
    "active_token_count",
    "is_last_admin",
]

ROLES = ("hook", "viewer", "operator", "admin")
# hook tokens rank below viewer: they may not read the REST API.
ROLE_LEVEL = {"hook": 0, "viewer": 1, "operator": 2, "admin": 3}
TOKEN_PREFIX = "rb_"


@dataclass(frozen=True, slots=True)
class Actor:
    """Who is calling: token name (or ``anonymous`` in open mode), role, job scope, address."""

    name: str
    role: str
    job: str | None = None
    address: str | None = None
    token_id: int | None = None


def role_allows(role: str, needed: str) -> bool:
    return ROLE_LEVEL.get(role, -1) >= ROLE_LEVEL[needed]


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _check_role(role: str, job: str | None) -> None:
    if role not in ROLES:
        raise ValueError(f"Unknown role {role!r}; expected one of {', '.join(ROLES)}.")
    if role == "hook" and not job:
        raise ValueError("A hook token must be scoped to a job; pass --job NAME.")
    if role == "hook" and job:
        check_job_name(job)  # the hook protocol's rule: a token for a name no hello may carry is useless
    if role != "hook" and job:
        raise ValueError("Only hook tokens are scoped to a job; drop the job for this role.")


def create_token(
    session: Session, *, role: str, name: str = "", job: str | None = None,
    created_by: str = "", secret: str | None = None,
) -> tuple[TokenRow, str]:
    """Create a token; returns the row and the secret (shown once, never stored)."""
    _check_role(role, job)
    secret = secret or TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = TokenRow(
        name=name or f"{role}-{secret[len(TOKEN_PREFIX):len(TOKEN_PREFIX) + 6]}", role=role, job=job,
        secret_sha256=hash_secret(secret), hint=secret[:8], created_by=created_by,
    )
    session.add(row)
    session.flush()
    return row, secret


def list_tokens(session: Session, *, include_revoked: bool = False) -> list[TokenRow]:
    q = select(TokenRow).order_by(TokenRow.id)
    if not include_revoked:
        q = q.where(TokenRow.revoked_at.is_(None))
    return list(session.scalars(q))


def revoke_token(session: Session, token_id: int) -> TokenRow | None:
    row = session.get(TokenRow, token_id)
    if row is not None and row.revoked_at is None:
        row.revoked_at = time.time()
    return row


def is_last_admin(session: Session, row: TokenRow) -> bool:
    """True when ``row`` is the only admin token not revoked: revoking it would leave nobody
    who can administer over the API."""
    if row.role != "admin" or row.revoked_at is not None:
        return False
    admins = select(func.count(TokenRow.id)).where(TokenRow.role == "admin", TokenRow.revoked_at.is_(None))
    return int(session.scalar(admins) or 0) <= 1


def active_token_count(session: Session) -> int:
    return int(session.scalar(select(func.count(TokenRow.id)).where(TokenRow.revoked_at.is_(None))) or 0)


class AuthService:
    """Resolves bearer secrets to actors, with a short cache so requests rarely hit SQL.

    Tokens created or revoked by another process (``rebalancer token``) take effect within
    ``cache_s`` seconds.
    """

    def __init__(self, session_factory: sessionmaker, *, loopback: bool, cache_s: float = 5.0):
        self._sf = session_factory
        self.loopback = loopback
        self.cache_s = cache_s
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Actor | None]] = {}
        self._count: tuple[float, int] | None = None

    def ensure_admin(self, secret: str) -> None:
        """Bootstrap: make sure an admin token with this secret exists (and is not revoked).

        Replicas starting together on a fresh database may both find no row: the one whose
        insert loses on the unique secret hash reads the row the other made."""
        for attempt in range(2):
            with self._sf() as s:
                try:
                    row = s.scalar(select(TokenRow).where(TokenRow.secret_sha256 == hash_secret(secret)))
                    if row is None:
                        create_token(s, role="admin", name="bootstrap-admin", secret=secret, created_by="settings")
                    elif row.revoked_at is not None or row.role != "admin":
                        row.revoked_at, row.role, row.job = None, "admin", None
                    s.commit()
                    break
                except IntegrityError:
                    s.rollback()
                    if attempt:
                        raise
        self.invalidate()

    def invalidate(self) -> None:
        with self._lock:
            self._cache.clear()
            self._count = None

    def revoked_among(self, token_ids: list[int]) -> set[int]:
        """Those of ``token_ids`` that are revoked now (or deleted), straight from the database."""
        if not token_ids:
            return set()
        with self._sf() as s:
            active = set(s.scalars(select(TokenRow.id).where(
                TokenRow.id.in_(token_ids), TokenRow.revoked_at.is_(None))))
        return set(token_ids) - active

    def token_count(self) -> int:
        now = time.monotonic()
        with self._lock:
            if self._count and now - self._count[0] < self.cache_s:
                return self._count[1]
        with self._sf() as s:
            n = active_token_count(s)
        with self._lock:
            self._count = (now, n)
        return n

    @property
    def open_mode(self) -> bool:
        """True while anyone may act as admin (loopback bind, no active tokens)."""
        return self.loopback and self.token_count() == 0

    def cached(self, secret: str | None, address: str | None = None) -> tuple[bool, Actor | None]:
        """(True, what ``authenticate`` would answer) when that needs no SQL (a fresh cache
        entry), else (False, None): async callers then run ``authenticate`` on the SQL thread."""
        now = time.monotonic()
        with self._lock:
            if not secret:
                fresh = self._count is not None and now - self._count[0] < self.cache_s
                if not fresh:
                    return False, None
                open_mode = self.loopback and self._count is not None and self._count[1] == 0
                return True, Actor("anonymous", "admin", None, address) if open_mode else None
            hit = self._cache.get(hash_secret(secret))
        if hit is None or now - hit[0] >= self.cache_s:
            return False, None
        actor = hit[1]
        return True, (None if actor is None else
                      Actor(actor.name, actor.role, actor.job, address, actor.token_id))

    def authenticate(self, secret: str | None, address: str | None = None) -> Actor | None:
        """The actor for a bearer secret; None when missing or invalid (outside open mode)."""
        if not secret:
            return Actor("anonymous", "admin", None, address) if self.open_mode else None
        digest = hash_secret(secret)
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
        if hit is None or now - hit[0] >= self.cache_s:
            with self._sf() as s:
                row = s.scalar(select(TokenRow).where(TokenRow.secret_sha256 == digest))
                actor = None
                if (row is not None and row.revoked_at is None
                        and hmac.compare_digest(row.secret_sha256, digest)):
                    actor = Actor(row.name, row.role, row.job, None, row.id)
            with self._lock:
                if len(self._cache) > 10_000:
                    self._cache.clear()
                self._cache[digest] = (now, actor)
        else:
            actor = hit[1]
        if actor is None:
            # An unknown secret in open mode is still a mistake worth refusing: the caller
            # meant to authenticate, and silently upgrading it would hide a typo.
            return None
        return Actor(actor.name, actor.role, actor.job, address, actor.token_id)

"""Who may do what: the one home of the backend's access decisions.

``allows(actor, need)`` for an authenticated actor (a missing or invalid token is refused
before it is asked): ``need`` is a role (viewer < operator < admin: at least that one) or
``SEND_METRICS`` (``/ws/hook``: a hook token, for its own job only, or an admin token). The
REST dependencies and the edge (``backend.api.deps``), ``GET /metrics``, both websockets
and the hook conversation in ingest ask it; each answers a refusal its own way (401/403
with the REST sentences, or a close code and a sentence).
"""

from __future__ import annotations

from backend.auth.tokens import Actor, role_allows

__all__ = ["SEND_METRICS", "HOOK_ROLES", "allows"]

SEND_METRICS = "send_metrics"
# The roles that may speak on /ws/hook; a hook token only for the job it names.
HOOK_ROLES = ("hook", "admin")


def allows(actor: Actor, need: str, *, job: str | None = None) -> bool:
    """True when ``actor`` may do what needs ``need``; for ``SEND_METRICS`` with ``job``,
    may speak for that job (None asks only the role)."""
    if need == SEND_METRICS:
        return actor.role in HOOK_ROLES and (job is None or actor.role != "hook" or actor.job == job)
    return role_allows(actor.role, need)

"""The control loop's records: a new job, placement versions, proposals, overrides.

Functions over an open session of ``backend.storage.control``; the caller commits. Each
closes or adds rows the way the proposal lifecycle says (``proposed`` -> ``approved`` ->
``applied``, or ``rejected | superseded | failed | expired``) and touches nothing else;
the controller keeps its in-memory state in step with what these return.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select

from backend.control.effect import effect_record
from backend.control.errors import ConflictError, NotFoundError
from backend.control.inputs import OVERRIDE_KEYS
from backend.storage import control as db
from trainer_hook.protocol import Hello, uniform_shares

__all__ = [
    "create_job", "fail_placement", "store_overrides", "actor_name", "pending_proposal", "proposal_to_decide", "decide", "close_pending",
    "expire_due", "new_placement", "add_proposal", "refused_before", "last_effect",
]


_PENDING = ("proposed", "approved")


def create_job(s: Any, hello: Hello, *, mode: str, actor: str, at: float) -> None:
    """Settings and the first placement (the uniform split) of a job new to this backend."""
    job = hello.job
    shares = uniform_shares(hello.world_size, hello.global_batch_size)
    # A job that already runs a version this backend never recorded (its database
    # was replaced) must get a newer one, or the hook would refuse it as stale.
    first = hello.placement_version + 1 if hello.placement_version > 0 else 0
    row = s.scalar(select(db.JobRow).where(db.JobRow.name == job))
    if row is None:  # ingest stores the row on hello; a direct caller may come first
        row = db.JobRow(name=job, world_size=hello.world_size,
                        global_batch_size=hello.global_batch_size, created_at=at, last_seen=at)
        s.add(row)
    row.world_size, row.global_batch_size = hello.world_size, hello.global_batch_size
    row.mode, row.policy, row.updated_at = mode, {}, at
    s.add(db.PlacementRow(
        job=job, version=first, shares=shares, source="initial", actor=actor,
        reason="uniform split for a new job", created_at=at, acks={},
    ))
    db.record_audit(s, actor=actor, action="job.create", job=job,
                    params={"world_size": hello.world_size,
                            "global_batch_size": hello.global_batch_size},
                    reason="first hello from the job")


def fail_placement(s: Any, row: db.PlacementRow, *, rank: int, reason: str, actor: str) -> None:
    """A rank refused placement ``row``: it, and its proposal if still pending, failed."""
    error = f"rank {rank} rejected placement version {row.version}: {reason}"
    row.failed = True
    row.error = error
    if row.proposal_id is not None:
        prop = s.get(db.ProposalRow, row.proposal_id)
        if prop is not None and prop.status in _PENDING:
            prop.status = "failed"
            prop.error = error
    db.record_audit(s, actor=actor, action="placement.failed", job=row.job,
                    params={"version": row.version, "rank": rank}, reason=reason)


def store_overrides(s: Any, job: str, ov: dict[str, Any], *, actor: Any, reason: str | None,
                    at: float) -> None:
    """Replace the job's overrides (as ``validate_overrides`` returns them), audited."""
    row = s.get(db.OverridesRow, job) or db.OverridesRow(job=job)
    row.pins = {str(k): v for k, v in ov["pins"].items()}
    row.caps = {str(k): v for k, v in ov["caps"].items()}
    row.floors = {str(k): v for k, v in ov["floors"].items()}
    row.drains, row.granularity = list(ov["drains"]), ov["granularity"]
    row.actor, row.reason, row.updated_at = actor_name(actor), reason or "", at
    s.add(row)
    db.record_audit(s, actor=actor, action="job.overrides", job=job,
                    params={k: ov[k] for k in OVERRIDE_KEYS}, reason=reason)


def actor_name(actor: Any) -> str:
    return actor if isinstance(actor, str) else str(getattr(actor, "name", actor))


def pending_proposal(s: Any, job: str) -> db.ProposalRow | None:
    """The newest proposal still waiting for an operator, else the newest approved one."""
    rows = db.list_proposals(s, job, status="proposed", limit=1)
    if rows:
        return rows[0]
    rows = db.list_proposals(s, job, status="approved", limit=1)
    return rows[0] if rows else None


def proposal_to_decide(s: Any, job: str, proposal_id: int, verb: str) -> db.ProposalRow:
    """The proposal an operator approves or rejects; only a proposed one may be."""
    prop = db.get_proposal(s, job, proposal_id)
    if prop is None:
        raise NotFoundError(f"Proposal {proposal_id} not found for job '{job}'.")
    if prop.status != "proposed":
        raise ConflictError(f"Proposal {proposal_id} is {prop.status}; only a proposed one can be {verb}.")
    return prop


def decide(prop: db.ProposalRow, status: str, why: str, at: float, *, by: Any = None) -> None:
    """Close a proposal: its new status, why, when and (for an operator's decision) who."""
    prop.status, prop.decision_reason, prop.decided_at = status, why, at
    if by is not None:
        prop.decided_by = actor_name(by)


def close_pending(s: Any, job: str, status: str, why: str, at: float, keep: int | None = None) -> None:
    """Close every proposed proposal of ``job`` but ``keep``."""
    for p in db.list_proposals(s, job, status="proposed"):
        if p.id != keep:
            decide(p, status, why, at)


def expire_due(s: Any, now: float) -> list[str]:
    """Mark proposed proposals past their TTL expired; returns the job of each."""
    rows = s.scalars(select(db.ProposalRow).where(
        db.ProposalRow.status == "proposed", db.ProposalRow.expires_at < now)).all()
    for p in rows:
        decide(p, "expired", "older than its TTL", now)
    return [p.job for p in rows]


def new_placement(s: Any, job: str, shares: Sequence[int], *, source: str, actor: Any, reason: str,
                  at: float, proposal_id: int | None = None,
                  current: db.PlacementRow | None | bool = True,
                  predicted_step_ms: float | None = None, auto: bool = False) -> db.PlacementRow:
    """Add the next placement version after ``current`` (True: the one in force; None: no
    previous shares to return to). Approved proposals it overtakes are superseded."""
    newest = db.latest_placement(s, job, include_failed=True)
    version = newest.version + 1 if newest is not None else 0
    if current is True:
        current = db.latest_placement(s, job)
    prev = current if isinstance(current, db.PlacementRow) else None
    row = db.PlacementRow(
        job=job, version=version, shares=list(shares),
        previous_shares=list(prev.shares) if prev else None,
        previous_version=prev.version if prev else None,
        source=source, proposal_id=proposal_id, actor=actor_name(actor), reason=reason,
        created_at=at, acks={}, auto=auto, predicted_step_ms=predicted_step_ms,
    )
    s.add(row)
    # Older proposals approved but not yet applied will never be: the hook takes the newest.
    for p in db.list_proposals(s, job, status="approved"):
        if p.id != proposal_id:
            p.status, p.error = "superseded", f"placement version {version} replaced it before every rank applied it"
    s.flush()
    return row


def add_proposal(s: Any, job: str, *, base_version: int, current_shares: Sequence[int],
                 shares: Sequence[int], source: str, strategy: str, actor: Any, reason: str,
                 at: float, ttl_s: float, explanation: dict[str, Any] | None = None,
                 before: float | None = None, after: float | None = None,
                 gain: float | None = None) -> db.ProposalRow:
    """Add a proposed change from ``current_shares`` (version ``base_version``) to ``shares``."""
    row = db.ProposalRow(
        job=job, status="proposed", source=source, strategy=strategy, base_version=base_version,
        shares=list(shares), current_shares=list(current_shares), predicted_step_ms_before=before,
        predicted_step_ms_after=after, predicted_gain=gain, explanation=explanation,
        reason=reason, created_by=actor_name(actor), created_at=at, expires_at=at + ttl_s,
    )
    s.add(row)
    s.flush()
    return row


def refused_before(s: Any, job: str, version: int, shares: list[int]) -> str | None:
    """Why the same split must not be proposed again (operator rejected it against this
    version, or it was rolled back for making things worse), else None."""
    for p in db.list_proposals(s, job, status="rejected", limit=20):
        if list(p.shares) == shares and p.base_version == version:
            return f"proposal {p.id} with this split was rejected; the policy waits for a change"
    for row in db.list_placements(s, job, limit=20):
        if row.rolled_back and list(row.shares) == shares:
            return f"this split (version {row.version}) was rolled back because it made steps slower"
    return None


def last_effect(s: Any, job: str) -> dict[str, Any] | None:
    """The effect of the newest measured placement among the last 20."""
    for row in db.list_placements(s, job, limit=20):
        if row.step_ms_after is not None:
            return effect_record(row)
    return None

"""Control state in SQL: job settings (on the ``jobs`` row), overrides, placements, proposals and the audit log.

Everything the controller decides lives here so that a backend restart loses nothing:
hooks reconnect, say ``hello`` and get the placement in force back from these tables.
Times are stored as Unix seconds (floats) so SQLite and PostgreSQL behave the same.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import JSON, Boolean, Float, Integer, String, Text, UniqueConstraint, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from backend.storage.base import Base
from backend.storage.metrics import JobRow

__all__ = [
    "JobRow",
    "OverridesRow",
    "PlacementRow",
    "ProposalRow",
    "AuditRow",
    "PROPOSAL_STATUSES",
    "record_audit",
    "get_settings",
    "list_settings",
    "latest_placement",
    "list_placements",
    "get_placement",
    "list_proposals",
    "get_proposal",
    "list_audit",
    "proposal_counts",
    "activity_counts",
    "PROPOSAL_SOURCES",
    "PLACEMENT_SOURCES",
]

PROPOSAL_STATUSES = ("proposed", "approved", "applied", "rejected", "superseded", "failed", "expired")
# Every source a proposal or a placement row can have (the counters export each, from 0).
PROPOSAL_SOURCES = ("policy", "manual", "override")
PLACEMENT_SOURCES = ("initial", "policy", "auto", "manual", "override", "rollback", "cost_model")


class OverridesRow(Base):
    """The operator's constraints for a job: pins, caps, floors, drains, granularity."""

    __tablename__ = "control_overrides"
    job: Mapped[str] = mapped_column(String(128), primary_key=True)
    pins: Mapped[dict[str, int]] = mapped_column(JSON, default=dict)
    caps: Mapped[dict[str, int]] = mapped_column(JSON, default=dict)
    floors: Mapped[dict[str, int]] = mapped_column(JSON, default=dict)
    drains: Mapped[list[int]] = mapped_column(JSON, default=list)
    granularity: Mapped[int] = mapped_column(Integer, default=1)
    actor: Mapped[str] = mapped_column(String(128), default="")
    reason: Mapped[str] = mapped_column(Text, default="")
    updated_at: Mapped[float] = mapped_column(Float, default=time.time)


class PlacementRow(Base):
    """One placement version of a job, with its acks and the measured effect."""

    __tablename__ = "control_placements"
    __table_args__ = (UniqueConstraint("job", "version", name="uq_control_placements_job_version"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job: Mapped[str] = mapped_column(String(128), index=True)
    version: Mapped[int]
    shares: Mapped[list[int]] = mapped_column(JSON)
    # Exact shares in force before this one, so that a rollback restores them exactly.
    previous_shares: Mapped[list[int] | None] = mapped_column(JSON, nullable=True)
    previous_version: Mapped[int | None]
    source: Mapped[str] = mapped_column(String(16))  # initial|static|policy|auto|manual|rollback
    proposal_id: Mapped[int | None]
    actor: Mapped[str] = mapped_column(String(128), default="")
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    effective_batch_index: Mapped[int | None]
    acks: Mapped[dict[str, int]] = mapped_column(JSON, default=dict)  # rank -> batch index
    applied_at: Mapped[float | None]
    failed: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    auto: Mapped[bool] = mapped_column(Boolean, default=False)
    predicted_step_ms: Mapped[float | None]
    step_ms_before: Mapped[float | None]
    step_ms_after: Mapped[float | None]
    measured_gain: Mapped[float | None]
    rolled_back: Mapped[bool] = mapped_column(Boolean, default=False)
    # A pipelined job's stage-model prediction and its check (policy.pipeline_check.PredictionRecord).
    prediction: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    def public(self) -> dict[str, Any]:
        """The Placement resource of docs/architecture.md."""
        return {
            "version": self.version,
            "shares": list(self.shares),
            "previous_shares": list(self.previous_shares) if self.previous_shares is not None else None,
            "source": self.source,
            "proposal_id": self.proposal_id,
            "actor": self.actor,
            "reason": self.reason,
            "created_at": self.created_at,
            "effective_batch_index": self.effective_batch_index,
            "acks": {int(k): v for k, v in sorted((self.acks or {}).items(), key=lambda kv: int(kv[0]))},
            "applied_at": self.applied_at,
            "failed": self.failed,
            "error": self.error,
            "effect": {
                "step_ms_before": self.step_ms_before,
                "step_ms_after": self.step_ms_after,
                "predicted_step_ms": self.predicted_step_ms,
                "measured_gain": self.measured_gain,
                "rolled_back": self.rolled_back,
                "prediction": self.prediction,
            },
        }


class ProposalRow(Base):
    """A candidate placement and what happened to it."""

    __tablename__ = "control_proposals"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job: Mapped[str] = mapped_column(String(128), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    source: Mapped[str] = mapped_column(String(16))  # policy|manual|static|override
    strategy: Mapped[str] = mapped_column(String(32), default="")
    base_version: Mapped[int]
    shares: Mapped[list[int]] = mapped_column(JSON)
    current_shares: Mapped[list[int]] = mapped_column(JSON)
    predicted_step_ms_before: Mapped[float | None]
    predicted_step_ms_after: Mapped[float | None]
    predicted_gain: Mapped[float | None]
    explanation: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    created_by: Mapped[str] = mapped_column(String(128), default="")
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    expires_at: Mapped[float | None]
    decided_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    decided_at: Mapped[float | None]
    decision_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    placement_version: Mapped[int | None]
    error: Mapped[str | None] = mapped_column(Text, nullable=True)

    def public(self) -> dict[str, Any]:
        """The Proposal resource of docs/architecture.md."""
        return {
            "id": self.id,
            "job": self.job,
            "status": self.status,
            "source": self.source,
            "strategy": self.strategy,
            "base_version": self.base_version,
            "shares": list(self.shares),
            "current_shares": list(self.current_shares),
            "predicted_step_ms_before": self.predicted_step_ms_before,
            "predicted_step_ms_after": self.predicted_step_ms_after,
            "predicted_gain": self.predicted_gain,
            "explanation": self.explanation,
            "reason": self.reason,
            "created_by": self.created_by,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "decided_by": self.decided_by,
            "decided_at": self.decided_at,
            "decision_reason": self.decision_reason,
            "placement_version": self.placement_version,
            "error": self.error,
        }


class AuditRow(Base):
    """One mutating action: who, from where, when, what, with which parameters and why."""

    __tablename__ = "control_audit"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    time: Mapped[float] = mapped_column(Float, default=time.time, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16), default="")
    address: Mapped[str] = mapped_column(String(128), default="")
    action: Mapped[str] = mapped_column(String(64))
    job: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    reason: Mapped[str] = mapped_column(Text, default="")

    def public(self) -> dict[str, Any]:
        """The Audit resource of docs/architecture.md."""
        return {
            "id": self.id,
            "time": self.time,
            "actor": self.actor,
            "role": self.role,
            "address": self.address,
            "action": self.action,
            "job": self.job,
            "params": self.params,
            "reason": self.reason,
        }


def record_audit(
    session: Session,
    *,
    actor: Any,
    action: str,
    job: str | None,
    params: dict[str, Any] | None = None,
    reason: str | None = None,
) -> AuditRow:
    """Add an audit record to ``session`` (the caller commits with its own change).

    ``actor`` is an ``Actor`` (name, role, address) from ``backend.auth.tokens`` or a plain
    string such as ``"controller"`` for the backend's own decisions.
    """
    if isinstance(actor, str):
        name, role, address = actor, "system", ""
    else:
        name = str(getattr(actor, "name", actor))
        role = str(getattr(actor, "role", "") or "")
        address = str(getattr(actor, "address", "") or "")
    row = AuditRow(
        time=time.time(), actor=name, role=role, address=address, action=action, job=job,
        params=dict(params or {}), reason=reason or "",
    )
    session.add(row)
    return row


def list_settings(session: Session) -> Sequence[JobRow]:
    """Every job the controller has taken on (its mode is set)."""
    return session.scalars(select(JobRow).where(JobRow.mode.is_not(None)).order_by(JobRow.name)).all()


def get_settings(session: Session, job: str) -> JobRow | None:
    """The job row, if the controller has taken the job on (its mode is set)."""
    row = session.scalar(select(JobRow).where(JobRow.name == job))
    return row if row is not None and row.mode is not None else None


def latest_placement(session: Session, job: str, *, include_failed: bool = False) -> PlacementRow | None:
    """The newest placement of ``job`` (the one in force unless it failed)."""
    stmt = select(PlacementRow).where(PlacementRow.job == job)
    if not include_failed:
        stmt = stmt.where(PlacementRow.failed.is_(False))
    return session.scalars(stmt.order_by(PlacementRow.version.desc()).limit(1)).first()


def get_placement(session: Session, job: str, version: int) -> PlacementRow | None:
    stmt = select(PlacementRow).where(PlacementRow.job == job, PlacementRow.version == version)
    return session.scalars(stmt).first()


def list_placements(session: Session, job: str, *, limit: int = 100) -> Sequence[PlacementRow]:
    """Newest first."""
    stmt = select(PlacementRow).where(PlacementRow.job == job).order_by(PlacementRow.version.desc())
    return session.scalars(stmt.limit(limit)).all()


def get_proposal(session: Session, job: str, proposal_id: int) -> ProposalRow | None:
    row = session.get(ProposalRow, proposal_id)
    return row if row is not None and row.job == job else None


def list_proposals(
    session: Session, job: str, *, status: str | None = None, limit: int = 100
) -> Sequence[ProposalRow]:
    """Newest first, optionally only those in one status."""
    stmt = select(ProposalRow).where(ProposalRow.job == job)
    if status is not None:
        stmt = stmt.where(ProposalRow.status == status)
    return session.scalars(stmt.order_by(ProposalRow.id.desc()).limit(limit)).all()


def list_audit(
    session: Session, job: str | None = None, *, action: str | None = None, limit: int = 200
) -> Sequence[AuditRow]:
    """Newest first; ``job=None`` lists every job's records."""
    stmt = select(AuditRow)
    if job is not None:
        stmt = stmt.where(AuditRow.job == job)
    if action is not None:
        stmt = stmt.where(AuditRow.action == action)
    return session.scalars(stmt.order_by(AuditRow.id.desc()).limit(limit)).all()


def proposal_counts(session: Session, job: str) -> dict[str, int]:
    """Number of proposals of ``job`` in each status (every status present, zeros too)."""
    out = dict.fromkeys(PROPOSAL_STATUSES, 0)
    stmt = (select(ProposalRow.status, func.count(ProposalRow.id))
            .where(ProposalRow.job == job).group_by(ProposalRow.status))
    for status, n in session.execute(stmt):
        out[status] = int(n)
    return out


def activity_counts(session: Session, job: str) -> dict[str, dict[str, int]]:
    """Counts of ``job``'s stored rows, for counters that survive a restart: proposals made
    and placement versions issued by source (every known source, zeros too), and placements
    a hook rejected (``{"failed": {"": n}}``)."""
    proposals = dict.fromkeys(PROPOSAL_SOURCES, 0)
    for source, n in session.execute(select(ProposalRow.source, func.count(ProposalRow.id))
                                     .where(ProposalRow.job == job).group_by(ProposalRow.source)):
        proposals[source] = int(n)
    placements = dict.fromkeys(PLACEMENT_SOURCES, 0)
    failed = 0
    for source, bad, n in session.execute(
            select(PlacementRow.source, PlacementRow.failed, func.count(PlacementRow.id))
            .where(PlacementRow.job == job).group_by(PlacementRow.source, PlacementRow.failed)):
        placements[source] = placements.get(source, 0) + int(n)
        failed += int(n) if bad else 0
    return {"proposals": proposals, "placements": placements, "failed": {"": failed}}

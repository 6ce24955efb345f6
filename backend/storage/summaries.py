"""Run summaries (savings against the uniform split, latest figures), the dashboard's
per-batch job series, and the retention of metric history.

The dashboard hub computes savings and the per-batch series from live state; the parts'
persist loop stores them here (``save_summary``, ``insert_points``) so that they survive a
restart: ``GET /api/v1/jobs/{job}/summary`` serves the stored summary and the hub refills a
job's charts from ``recent_points``. ``delete_older_than`` is the retention rule.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CursorResult,
    Float,
    Index,
    Integer,
    String,
    delete,
    insert,
    select,
)
from sqlalchemy.orm import Mapped, Session, mapped_column

from backend.storage.base import Base
from backend.storage.metrics import RankMetricRow

__all__ = ["RunSummaryRow", "JobMetricRow", "save_summary", "get_summary", "insert_points",
           "recent_points", "delete_older_than", "SUMMARY_FIELDS", "POINT_FIELDS"]

SUMMARY_FIELDS = ("batch_index", "total_steps", "measured_s", "uniform_s", "saved_s", "saved_cost",
                  "cost_per_hour", "step_ms", "imbalance", "placement_version")
POINT_FIELDS = ("batch_index", "t", "step_ms", "max_compute_ms", "mean_compute_ms", "throughput",
                "uniform_step_ms", "version")


class RunSummaryRow(Base):
    """The newest summary of a job's run: savings against the uniform split and figures."""

    __tablename__ = "run_summaries"

    job: Mapped[str] = mapped_column(String(128), primary_key=True)
    batch_index: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    total_steps: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    measured_s: Mapped[float]
    uniform_s: Mapped[float]
    saved_s: Mapped[float]
    saved_cost: Mapped[float | None]
    cost_per_hour: Mapped[float | None]
    step_ms: Mapped[float | None]
    imbalance: Mapped[float | None]
    placement_version: Mapped[int | None]
    updated_at: Mapped[float] = mapped_column(Float, default=time.time)
    # The end-of-run report (backend/report), stored when every rank said goodbye or on demand.
    report: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    report_reason: Mapped[str | None] = mapped_column(String(128), nullable=True)
    report_at: Mapped[float | None]

    def public(self) -> dict[str, Any]:
        return {"job": self.job, **{k: getattr(self, k) for k in SUMMARY_FIELDS},
                "updated_at": self.updated_at}


class JobMetricRow(Base):
    """One closed batch of a job as the dashboard plots it (slowest rank, uniform estimate)."""

    __tablename__ = "job_metrics"
    __table_args__ = (Index("ix_job_metrics_job_batch", "job", "batch_index"),
                      Index("ix_job_metrics_t", "t"))

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job: Mapped[str] = mapped_column(String(128))
    t: Mapped[float]
    batch_index: Mapped[int] = mapped_column(BigInteger)
    step_ms: Mapped[float]
    max_compute_ms: Mapped[float]
    mean_compute_ms: Mapped[float]
    throughput: Mapped[float | None]
    uniform_step_ms: Mapped[float | None]
    version: Mapped[int]


def save_summary(s: Session, job: str, values: Mapping[str, Any], at: float) -> None:
    """Insert or replace the job's summary (caller commits)."""
    row = s.get(RunSummaryRow, job)
    if row is None:
        row = RunSummaryRow(job=job)
        s.add(row)
    for k in SUMMARY_FIELDS:
        setattr(row, k, values.get(k))
    for k in ("measured_s", "uniform_s", "saved_s"):
        setattr(row, k, float(values.get(k) or 0.0))
    row.updated_at = at


def get_summary(s: Session, job: str) -> dict[str, Any] | None:
    row = s.get(RunSummaryRow, job)
    return row.public() if row is not None else None


def insert_points(s: Session, job: str, points: Sequence[Mapping[str, Any]], at: float) -> int:
    """Store closed-batch points (the hub's series entries, ``b`` is the batch index)."""
    if not points:
        return 0
    s.execute(insert(JobMetricRow), [
        {"job": job, "t": at, "batch_index": p["b"], "step_ms": p["step_ms"],
         "max_compute_ms": p["max_compute_ms"], "mean_compute_ms": p["mean_compute_ms"],
         "throughput": p["throughput"], "uniform_step_ms": p["uniform_step_ms"],
         "version": p["version"]} for p in points])
    return len(points)


def recent_points(s: Session, job: str, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` points of a job, oldest first, in the hub's series shape."""
    rows = s.scalars(select(JobMetricRow).where(JobMetricRow.job == job)
                     .order_by(JobMetricRow.batch_index.desc()).limit(limit)).all()
    return [{"b": r.batch_index, "step_ms": r.step_ms, "max_compute_ms": r.max_compute_ms,
             "mean_compute_ms": r.mean_compute_ms, "throughput": r.throughput,
             "uniform_step_ms": r.uniform_step_ms, "version": r.version} for r in reversed(rows)]


def delete_older_than(s: Session, cutoff: float) -> int:
    """Delete per-rank windows and per-batch job points from before ``cutoff`` (Unix
    seconds); returns rows deleted (caller commits). Summaries and control rows stay."""
    n = 0
    for stmt in (delete(RankMetricRow).where(RankMetricRow.t_end < cutoff),
                 delete(JobMetricRow).where(JobMetricRow.t < cutoff)):
        result: CursorResult[Any] = s.execute(stmt)  # type: ignore[assignment]
        n += result.rowcount or 0
    return n

"""End-of-run reports in SQL, and the reads of stored metric windows a report sums up.

The report is part of the run's summary (``storage.summaries.RunSummaryRow``: ``report``,
``report_reason``, ``report_at``): stored when every rank said goodbye or on demand, so that
it outlives the live state, a backend restart and the metric history's retention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Subquery, func, or_, select
from sqlalchemy.orm import Session

from backend.storage.metrics import RankMetricRow
from backend.storage.summaries import RunSummaryRow

__all__ = ["RankTotals", "save_report", "get_report", "rank_totals", "step_series", "fit_windows"]


def save_report(s: Session, job: str, body: dict[str, Any], reason: str, at: float) -> None:
    """Put the report into the job's run summary (a summary row is made from the report's
    own savings if the dashboard feed has not stored one yet). Caller commits."""
    row = s.get(RunSummaryRow, job)
    if row is None:
        sv = body.get("savings") or {}
        row = RunSummaryRow(job=job, measured_s=float(sv.get("measured_s") or 0.0),
                            uniform_s=float(sv.get("uniform_s") or 0.0), saved_s=float(sv.get("saved_s") or 0.0),
                            saved_cost=sv.get("saved_cost"), cost_per_hour=(body.get("cost") or {}).get("per_hour"),
                            updated_at=at)
        s.add(row)
    row.report, row.report_reason, row.report_at = body, reason, at


def get_report(s: Session, job: str) -> dict[str, Any] | None:
    row = s.get(RunSummaryRow, job)
    return dict(row.report) if row is not None and row.report is not None else None


@dataclass(frozen=True, slots=True)
class RankTotals:
    """One rank's stored windows summed: steps, and milliseconds spent in each part."""

    rank: int
    steps: int
    compute_ms: float
    sync_wait_ms: float
    data_wait_ms: float
    optimizer_ms: float
    step_ms: float
    samples: float
    t_start: float
    t_end: float
    batch_index_end: int


def _run_starts(job: str) -> Subquery:
    # A run starts at batch 0: per rank, the newest window holding batch 0 opens the current
    # run (a job name used again keeps its older runs' windows; a resumed run has no new 0).
    # Times are the hook's own clock, so each rank is compared with itself only.
    m = RankMetricRow
    return (select(m.rank.label("rank"), func.max(m.t_start).label("t0"))
            .where(m.job == job, m.batch_index_start == 0).group_by(m.rank).subquery())


def _in_current_run(starts: Subquery) -> ColumnElement[bool]:
    return or_(starts.c.t0.is_(None), RankMetricRow.t_start >= starts.c.t0)


def rank_totals(s: Session, job: str) -> list[RankTotals]:
    """Per rank, the stored windows of ``job``'s current run summed (one query)."""
    m = RankMetricRow
    n = m.n_steps
    starts = _run_starts(job)
    q = (select(m.rank, func.sum(n), func.sum(n * m.compute_ms), func.sum(n * m.sync_wait_ms),
                func.sum(n * m.data_wait_ms), func.sum(n * m.optimizer_ms), func.sum(n * m.step_ms),
                func.sum(n * m.local_batch_size), func.min(m.t_start), func.max(m.t_end),
                func.max(m.batch_index_end))
         .outerjoin(starts, starts.c.rank == m.rank)
         .where(m.job == job, _in_current_run(starts)).group_by(m.rank).order_by(m.rank))
    out = []
    for r in s.execute(q):
        f = [float(x or 0.0) for x in r[2:10]]
        out.append(RankTotals(rank=int(r[0]), steps=int(r[1] or 0), compute_ms=f[0], sync_wait_ms=f[1],
                              data_wait_ms=f[2], optimizer_ms=f[3], step_ms=f[4], samples=f[5],
                              t_start=f[6], t_end=f[7], batch_index_end=int(r[10] or 0)))
    return out


def step_series(s: Session, job: str, max_points: int = 2000) -> list[dict[str, Any]]:
    """Rank 0's windows (every rank of a synchronous job sees the same step), oldest first,
    thinned to at most ``max_points``: batch index, time, mean step and compute time,
    placement version."""
    m = RankMetricRow
    starts = _run_starts(job)
    rows = s.execute(select(m.batch_index_end, m.t_end, m.step_ms, m.compute_ms, m.placement_version)
                     .outerjoin(starts, starts.c.rank == m.rank)
                     .where(m.job == job, m.rank == 0, _in_current_run(starts))
                     .order_by(m.batch_index_end)).all()
    stride = max(1, -(-len(rows) // max_points))
    return [{"batch_index": int(r[0]), "t": float(r[1]), "step_ms": float(r[2]), "compute_ms": float(r[3]),
             "version": int(r[4])} for r in rows[::stride]]


def fit_windows(s: Session, job: str, rank: int, limit: int) -> list[tuple[int, float, float]]:
    """The newest ``limit`` windows of one rank, oldest first: (batch index, mean local
    batch size, mean compute ms), what the policy's fit reads."""
    m = RankMetricRow
    starts = _run_starts(job)
    rows = s.execute(select(m.batch_index_end, m.local_batch_size, m.compute_ms)
                     .outerjoin(starts, starts.c.rank == m.rank)
                     .where(m.job == job, m.rank == rank, _in_current_run(starts))
                     .order_by(m.batch_index_end.desc()).limit(limit)).all()
    return [(int(r[0]), float(r[1]), float(r[2])) for r in reversed(rows)]

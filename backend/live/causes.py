"""The one home of a live job's causes: its recent steps replayed (``backend.policy.causes``)
with the job's figures (steps done, devices per rank). REST, the job page and the report ask here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backend.live.forecast import forecast
from backend.live.rows import STEP_BATCH, STEP_COMPUTE, STEP_LOCAL_BATCH, STEP_MS
from backend.live.state import LiveState
from backend.policy.causes import CauseReport, CauseStep, attribute

__all__ = ["job_causes", "cause_costs", "CAUSE_WINDOW"]

CAUSE_WINDOW = 64  # recent steps replayed: about the policy's window, a few seconds of a fast job


def job_causes(live: LiveState, job: str, *, window: int = CAUSE_WINDOW) -> CauseReport | None:
    """The live job's causes of lost time, largest first; None when the job is not live."""
    view = live.view(job)
    if view is None:
        return None
    steps = {rank: _cause_steps(*taken) for rank, taken in live.cause_rows(job, window).items()}
    done = view.batch_index + 1 if view.batch_index is not None else 0
    per_rank = view.mesh.replica_size if view.mesh is not None else 1
    return attribute(steps, global_batch_size=view.global_batch_size, steps_done=done,
                     devices_per_rank=per_rank, window=window)


def cause_costs(live: LiveState, job: str, report: CauseReport,
                price_for: Callable[[str, str], float | None]) -> list[float | None]:
    """What each cause of ``report`` has cost so far in money: its time lost per step, over
    the steps done, at the job's hourly cost (None without prices)."""
    view = live.view(job)
    if view is None:
        return [None] * len(report.causes)
    cost_h = forecast(view, price_for).cost_per_hour
    done = view.batch_index + 1 if view.batch_index is not None else 0
    return [c.ms_per_step * done / 3.6e6 * cost_h if cost_h is not None else None for c in report.causes]


def _cause_steps(rows: list[tuple[Any, ...]], comm: dict[int, Any], phases: dict[int, Any],
                 work: dict[int, Any]) -> list[CauseStep]:
    """A rank's step rows as the replay reads them: times, phases, communication and work joined
    by batch index (the rows' layout: ``backend.live.rows``; 3, 5, 6: data wait, sync, optimizer)."""
    steps = []
    for row in rows:
        k = row[STEP_BATCH]
        c, p = comm.get(k), phases.get(k)
        steps.append(CauseStep(
            batch_index=k, local_batch_size=row[STEP_LOCAL_BATCH], data_wait_ms=row[3],
            compute_ms=row[STEP_COMPUTE], sync_wait_ms=row[5], optimizer_ms=row[6], step_ms=row[STEP_MS],
            host_ms=p[1] if p else 0.0, ckpt_ms=p[2] if p else 0.0, gc_ms=p[3] if p else 0.0,
            comm_bytes=c[1] if c else None, comm_ms=c[2] if c else None, work=work.get(k)))
    return steps

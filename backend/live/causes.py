"""The one home of a live job's causes: its recent steps replayed (``backend.policy.causes``)
with the job's figures (steps done, devices per rank). REST, the job page and the report ask here."""

from __future__ import annotations

from collections.abc import Callable

from backend.live.forecast import forecast
from backend.live.state import LiveState
from backend.policy.causes import CauseReport, attribute

__all__ = ["job_causes", "cause_costs", "CAUSE_WINDOW"]

CAUSE_WINDOW = 64  # recent steps replayed: about the policy's window, a few seconds of a fast job


def job_causes(live: LiveState, job: str, *, window: int = CAUSE_WINDOW) -> CauseReport | None:
    """The live job's causes of lost time, largest first; None when the job is not live."""
    view = live.view(job)
    if view is None:
        return None
    steps = live.cause_steps(job, window)
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

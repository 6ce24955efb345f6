"""The one home of a live job's causes: its recent steps replayed (``backend.policy.causes``)
with the job's figures (steps done, devices per rank). REST, the job page and the report ask here."""

from __future__ import annotations

from backend.live.state import LiveState
from backend.policy.causes import CauseReport, attribute

__all__ = ["job_causes", "CAUSE_WINDOW"]

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

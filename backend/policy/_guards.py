"""Memory of rolled-back changes: which way each rank may not be moved again, and why."""

from __future__ import annotations

import numpy as np

from ._fit import SHIFT_STEPS, valid_steps
from .types import JobObservation, StepSample

__all__ = ["rollback_blocks"]

# A rank's cost "changed" when its per-sample cost since the rollback differs by this much
# from its cost up to it (the same threshold as a level shift in the fit).
_CHANGED = 0.1


def _per_sample(steps: list[StepSample], a_ms: float) -> float | None:
    if len(steps) < SHIFT_STEPS:
        return None
    return float(np.median([max(s.compute_ms - a_ms, 0.0) / s.local_batch_size for s in steps]))


def rollback_blocks(obs: JobObservation, a_ms: tuple[float, ...],
                    window_steps: int) -> dict[int, int]:
    """Rank -> direction (+1: may not gain work, -1: may not lose work) from the rolled-back
    changes in ``obs.rollbacks``, for each rank whose measured cost has not changed since.

    A rolled-back change moved some ranks up and some down; the policy does not retry those
    directions until the per-sample cost of a rank it moved, measured after the rollback,
    differs by 10% from its cost measured up to it. Without steps on both sides, nothing is known to
    have changed: the block stays (the controller keeps only recent rollbacks).
    """
    blocks: dict[int, int] = {}
    for rb in obs.rollbacks:
        if len(rb.shares_before) != obs.world_size or len(rb.shares_after) != obs.world_size:
            continue
        moved = {i: 1 if new > old else -1
                 for i, (old, new) in enumerate(zip(rb.shares_before, rb.shares_after,
                                                    strict=True)) if new != old}
        if any(_changed(obs, i, rb.batch_index, a_ms[i], window_steps) for i in moved):
            # New evidence on a rank the change moved: the change may be right now, and an
            # older block on these ranks is void as well.
            for i in moved:
                blocks.pop(i, None)
            continue
        blocks.update(moved)
    return blocks


def _changed(obs: JobObservation, rank: int, at: int, a_ms: float, window_steps: int) -> bool:
    steps = valid_steps(obs.ranks[rank].steps, window_steps)
    then = _per_sample([s for s in steps if s.batch_index <= at], a_ms)
    since = _per_sample([s for s in steps if s.batch_index > at], a_ms)
    return then is not None and since is not None and then > 0 and \
        abs(since / then - 1.0) > _CHANGED

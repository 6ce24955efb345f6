"""Work units: with a per-sample cost, shares split each batch's work, not its samples.

The hook reports each step's ``work`` (the rank's summed cost, tokens say) and the global
batch's ``batch_work``. A share of ``b`` out of ``B`` means ``b / B`` of a batch's work, so
a step's measured time is fitted against ``work * B / mean batch work``: the rank's work in
share units. The fits, the solver and the guards then run unchanged, and a rank's speed is
judged from work-normalised times: a step that drew long samples is not a slow rank.
"""

from __future__ import annotations

import math
from dataclasses import replace

from .types import JobObservation, StepSample

__all__ = ["in_work_units", "mean_batch_work"]


def mean_batch_work(obs: JobObservation) -> float | None:
    """The mean work of a global batch over the steps seen (None without costs)."""
    seen: dict[int, float] = {}
    for r in obs.ranks:
        for s in r.steps:
            if s.batch_work is not None and math.isfinite(s.batch_work) and s.batch_work > 0:
                seen[s.batch_index] = s.batch_work
    if not seen:
        return None
    return sum(seen.values()) / len(seen)


def in_work_units(obs: JobObservation) -> JobObservation:
    """``obs`` with each step's ``local_batch_size`` in work units where steps carry a
    cost; steps without one are dropped then (units must not mix). Unchanged without costs."""
    wbar = mean_batch_work(obs)
    if wbar is None:
        return obs
    scale = obs.global_batch_size / wbar
    ranks = []
    for r in obs.ranks:
        steps = tuple(
            StepSample(s.batch_index, s.work * scale, s.compute_ms, s.work, s.batch_work)
            for s in r.steps if s.work is not None and s.work > 0
        )
        ranks.append(replace(r, steps=steps))
    return replace(obs, ranks=tuple(ranks))

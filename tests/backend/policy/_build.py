"""Builders of policy observations for the tests (seeded, no I/O)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from backend.policy import JobObservation, RankObservation, StepSample


def observe(a: Sequence[float], c: Sequence[float], shares: Sequence[int], *, steps: int = 30,
            noise: float = 0.0, seed: int = 0, version: int = 0,
            steps_since_change: int | None = None, device_types=None,
            outliers: dict[int, float] | None = None, **rank_extra) -> JobObservation:
    """Observation of a job whose rank i takes ``(a[i] + c[i]*b) * noise`` ms per step."""
    rnd = random.Random(seed)
    n = len(a)
    ranks = []
    for i in range(n):
        samples = []
        for k in range(steps):
            t = (a[i] + c[i] * shares[i]) * (1 + rnd.gauss(0, noise))
            if outliers and k % 7 == 3 and i in outliers:
                t *= outliers[i]  # e.g. a recompile or a GC pause
            samples.append(StepSample(k, shares[i], t))
        ranks.append(RankObservation(
            rank=i, device_type=device_types[i] if device_types else None,
            steps=tuple(samples), **{k: v[i] for k, v in rank_extra.items()}))
    return JobObservation(job="job", world_size=n, global_batch_size=sum(shares),
                          batch_index=steps - 1, shares=tuple(shares),
                          placement_version=version,
                          steps_since_change=steps if steps_since_change is None
                          else steps_since_change,
                          ranks=tuple(ranks))

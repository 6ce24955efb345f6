"""StepHistogram: one job's step wall times as a Prometheus histogram (owned by its job in
``LiveState``, which writes and reads it under its lock).

Every rank of a synchronous job sees the same step, so live state feeds it rank 0's steps
only. Buckets are ``backend.metrics_contract.STEP_BUCKETS_S``; ``/metrics`` exposes it as
``rebalancer_step_seconds``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

from backend.metrics_contract import STEP_BUCKETS_S

__all__ = ["StepHistogram", "cumulative"]


class StepHistogram:
    """Counts per ``STEP_BUCKETS_S`` bucket (the last one +Inf) and their sum in seconds."""

    __slots__ = ("buckets", "sum_s")

    def __init__(self) -> None:
        self.buckets = [0] * (len(STEP_BUCKETS_S) + 1)
        self.sum_s = 0.0

    def observe_ms(self, steps_ms: Iterable[float]) -> None:
        buckets = self.buckets
        for ms in steps_ms:
            step_s = ms / 1000.0
            buckets[bisect_left(STEP_BUCKETS_S, step_s)] += 1
            self.sum_s += step_s

    def snapshot(self) -> tuple[list[int], float]:
        """A copy of (counts per bucket, sum in seconds)."""
        return list(self.buckets), self.sum_s


def cumulative(counts: list[int]) -> tuple[int, ...]:
    """Per-bucket counts made cumulative, as Prometheus exposes a histogram."""
    running, out = 0, []
    for c in counts:
        running += c
        out.append(running)
    return tuple(out)

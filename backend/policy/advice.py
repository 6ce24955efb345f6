"""Cost-aware advice from the policy's model: what dropping each rank would do.

With each rank's fit ``t_i(b) = a_i + c_i * b`` the policy's solver gives the best split
of the global batch over all ranks and over all ranks but one (that one drained). The step
then takes the slowest rank's compute time plus what the split does not change
(synchronisation, optimizer: ``overhead_ms``). A rank "adds" the throughput lost without
it; it costs its price's share of the job's hourly cost. Where dropping it lowers the cost
per sample, the advice is to release it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .solver import predicted_step_ms, solve
from .types import Constraints, InfeasibleError

__all__ = ["RankDrop", "drop_effects"]


@dataclass(frozen=True, slots=True)
class RankDrop:
    """The predicted effect of running the job without ``rank``."""

    rank: int
    step_ms_without: float | None  # predicted step time without the rank (None: infeasible)
    shares_without: tuple[int, ...] | None
    throughput_gain: float | None  # throughput with the rank over without it, minus 1
    cost_share: float | None  # the rank's price over the job's hourly cost
    cost_per_sample_change: float | None  # dropping it: new cost per sample / old - 1
    advice: str


def _fmt_pct(x: float) -> str:
    return f"{x:.0%}" if abs(x) >= 0.01 else f"{x:.1%}"


def drop_effects(a_ms: Sequence[float], c_ms: Sequence[float], global_batch_size: int,
                 prices: Sequence[float | None], *, overhead_ms: float = 0.0,
                 constraints: Constraints | None = None) -> tuple[float, list[RankDrop]]:
    """The predicted step time with every rank at its best split, and for each rank the
    effect of dropping it. ``prices`` are USD per hour per rank (None: unknown)."""
    n = len(a_ms)
    if not (n == len(c_ms) == len(prices)):
        raise ValueError(f"a_ms, c_ms and prices must have one value per rank, got {n}, "
                         f"{len(c_ms)} and {len(prices)}.")
    if not math.isfinite(overhead_ms) or overhead_ms < 0:
        raise ValueError(f"overhead_ms must be a finite number >= 0, got {overhead_ms}.")
    base = constraints or Constraints()
    step_all = predicted_step_ms(a_ms, c_ms, solve(a_ms, c_ms, global_batch_size, base)) + overhead_ms
    priced = all(p is not None for p in prices)
    cost_h = sum(p for p in prices if p is not None) if priced else None
    out: list[RankDrop] = []
    for r in range(n):
        if n == 1:
            out.append(RankDrop(r, None, None, None, 1.0 if priced else None, None,
                                f"rank {r} is the only rank: keep it"))
            continue
        try:
            shares = solve(a_ms, c_ms, global_batch_size,
                           Constraints(pins=base.pins, caps=base.caps, floors=base.floors,
                                       drains=base.drains | {r}, granularity=base.granularity))
        except InfeasibleError:
            out.append(RankDrop(r, None, None, None, None, None,
                                f"rank {r} cannot be dropped: the other ranks cannot hold the batch"))
            continue
        step_wo = predicted_step_ms(a_ms, c_ms, shares) + overhead_ms
        gain = step_wo / step_all - 1.0 if step_all > 0 else None
        share = change = None
        if cost_h is not None and cost_h > 0 and gain is not None:
            p = prices[r] or 0.0
            share = p / cost_h
            # cost per sample = cost_h * step / B; B is the same with or without the rank
            change = ((cost_h - p) * step_wo) / (cost_h * step_all) - 1.0
        if gain is None:
            text = f"rank {r}: no prediction"
        elif share is None or change is None:
            text = f"rank {r} adds {_fmt_pct(gain)} throughput (no price known for the job)"
        elif change < 0:
            text = (f"rank {r} adds {_fmt_pct(gain)} throughput for {_fmt_pct(share)} of the cost: "
                    f"release it (cost per sample {_fmt_pct(change)})")
        else:
            text = (f"rank {r} adds {_fmt_pct(gain)} throughput for {_fmt_pct(share)} of the cost: "
                    f"keep it")
        out.append(RankDrop(r, step_wo, shares, gain, share, change, text))
    return step_all, out

"""When a new proposal may replace the one waiting for an operator (issue 39): when it is
clearly better under the same fit, and the waiting one has been up long enough to be read.

Noise alone moves every fit a little, and each fit has its own best split: replacing the
pending proposal with every run's answer replaced it several times a second on a noisy
job, and Approve then found the proposal on screen gone. ``gain_over`` prices the pending
split with the fit that found the new one, so both are judged alike."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .solver import predicted_step_ms
from .types import Explanation

__all__ = ["gain_over", "noise_margin", "replaces_pending"]


def gain_over(expl: Explanation, shares: Sequence[int]) -> float:
    """How much shorter the step ``expl`` predicts for its split is than the step the same
    fit predicts for ``shares`` (a fraction; the exposed communication, which no split
    changes, counted in both). ``inf`` when ``shares`` is not a split of this job."""
    ranks = sorted(expl.ranks, key=lambda r: r.rank)
    if len(ranks) != len(shares):
        return math.inf
    a = [r.a_ms for r in ranks]
    c = [r.c_ms for r in ranks]
    unsplit = expl.step_ms_before - predicted_step_ms(a, c, [r.share_before for r in ranks])
    other = predicted_step_ms(a, c, shares) + unsplit
    return (other - expl.step_ms_after) / other if other > 0 else 0.0


def noise_margin(expl: Explanation, shares: Sequence[int]) -> float:
    """Twice the largest relative standard error among the ranks whose share differs between
    ``expl``'s split and ``shares``: a gain below it may be the noise of the fit."""
    errs = [r.rel_error for r in expl.ranks
            if r.rank < len(shares) and r.share_after != shares[r.rank] and r.rel_error is not None]
    return 2.0 * max(errs, default=0.0)


def replaces_pending(expl: Explanation, pending_shares: Sequence[int], *, age_s: float,
                     margin: float, min_age_s: float) -> bool:
    """True when the proposal ``expl`` explains may replace a pending one of
    ``pending_shares`` that has waited ``age_s`` seconds: it is at least ``min_age_s`` old,
    and the new split's predicted step is shorter by ``margin`` plus the fit's noise."""
    if age_s < min_age_s:
        return False
    return gain_over(expl, pending_shares) >= margin + noise_margin(expl, pending_shares)

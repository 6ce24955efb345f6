"""Exact integer min-max split of the global batch (docs/design.md, "The policy's math").

Minimise ``max_i a_i + c_i * b_i`` subject to ``sum b_i = B``, per-rank bounds and a
granularity. The answer is the water-filling one: shares start at their lower bounds and
the remaining units go, one at a time, to the rank whose time after taking it is lowest
(ties: the rank with fewer units taken, then the lower rank). That greedy is exact for
min-max with increasing costs; a binary search on the step time T finds the level where
it stops, so only the last few units are placed one by one: O(N log) with numpy.

Granularity g: every share that is not pinned or drained is a multiple of g. When the
samples left after pins are not a multiple of g, the remainder r = R mod g goes to exactly
one rank (its share is r plus a multiple of g): the rank that gives the lowest optimum.
All ranks are tried when there are at most 64 free ranks; above that an O(N) pass gives
the same step time (see ``_fast_remainder``), except in the rare case where some rank's
bounds admit no multiple of g, when the 8 most promising ranks are tried.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from .bounds import NO_CONSTRAINTS, Bounds, _ranks_text, check_placement, rank_bounds
from .types import Constraints, InfeasibleError

__all__ = ["NO_CONSTRAINTS", "solve", "predicted_step_ms", "rank_bounds", "Bounds", "check_placement",
           "even_ties", "TIE_TOLERANCE"]

_EXACT_REMAINDER_RANKS = 64
_REMAINDER_CANDIDATES = 8


def _check_costs(a_ms: Sequence[float], c_ms: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    if len(a_ms) != len(c_ms):
        raise ValueError(
            f"a_ms and c_ms must have one value per rank, got {len(a_ms)} and {len(c_ms)}."
        )
    a = np.asarray(a_ms, dtype=float)
    c = np.asarray(c_ms, dtype=float)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(c))):
        raise ValueError("a_ms and c_ms must be finite numbers; got NaN or infinity.")
    if np.any(c < 0):
        bad = int(np.flatnonzero(c < 0)[0])
        raise ValueError(
            f"per-sample cost c_ms must be >= 0, got {c[bad]} for rank {bad}; "
            "a negative cost usually means a bad fit."
        )
    return a, c


def _water_fill(a: np.ndarray, c: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                units: int) -> np.ndarray:
    """Greedy min-max in units: ``lo <= k <= hi``, ``sum k == units``; cost a + c*k."""
    need = units - int(lo.sum())
    if need <= 0:
        return lo.copy()
    # A zero per-sample cost would make every unit of a rank tie; a tiny slope keeps the
    # order well defined (round-robin between such ranks) without changing real optima.
    c = np.where(c > 0, c, np.maximum(np.abs(a), 1.0) * 1e-12)

    def count(t: float) -> tuple[np.ndarray, int]:
        k = np.floor((t - a) / c)
        # Division rounds; make k agree with the direct test a + c*k <= t.
        k = np.where(a + c * (k + 1) <= t, k + 1, k)
        k = np.where(a + c * k > t, k - 1, k)
        k = np.clip(k, lo, hi)
        return k, int((k - lo).sum())

    # The continuous relaxation gives a good first bracket.
    t_lo = float(np.min(a + c * (lo + 1)) - 1.0)
    t_hi = float(np.max(np.where(hi > lo, a + c * hi, -np.inf)))
    guess = (units + float((a / c).sum())) / float((1.0 / c).sum())
    if t_lo < guess < t_hi:
        if count(guess)[1] >= need:
            t_hi = guess
        else:
            t_lo = guess
    for _ in range(200):
        mid = 0.5 * (t_lo + t_hi)
        if not t_lo < mid < t_hi:
            break
        got = count(mid)[1]
        if got == need:
            return count(mid)[0].astype(np.int64)
        if got > need:
            t_hi = mid
        else:
            t_lo = mid
    base, got = count(t_lo)
    base = base.astype(np.int64)
    top = count(t_hi)[0].astype(np.int64)
    missing = need - got
    extra = np.minimum(top - base, missing)
    idx = np.flatnonzero(extra > 0)
    if idx.size == 0:
        return base
    e = extra[idx]
    ranks = np.repeat(idx, e)
    k_next = np.repeat(base[idx] + 1, e) + np.arange(ranks.size) - np.repeat(np.cumsum(e) - e, e)
    values = a[ranks] + c[ranks] * k_next
    order = np.lexsort((ranks, k_next - lo[ranks], values))[:missing]
    np.add.at(base, ranks[order], 1)
    short = need - int((base - lo).sum())
    if short > 0:  # only if rounding hid units at t_hi: finish one unit at a time
        base = _greedy(a, c, base, hi.astype(np.int64), short)
    return base


def _greedy(a: np.ndarray, c: np.ndarray, k: np.ndarray, hi: np.ndarray,
            units: int) -> np.ndarray:
    heap = [(a[i] + c[i] * (k[i] + 1), 0, i) for i in range(k.size) if k[i] < hi[i]]
    heapq.heapify(heap)
    k = k.copy()
    for _ in range(units):
        _, taken, i = heapq.heappop(heap)
        k[i] += 1
        if k[i] < hi[i]:
            heapq.heappush(heap, (a[i] + c[i] * (k[i] + 1), taken + 1, i))
    return k


def _solve_free(a: np.ndarray, c: np.ndarray, lo: np.ndarray, hi: np.ndarray, g: int,
                total: int, rem_rank: int | None, rem: int) -> np.ndarray | None:
    """Shares of the free ranks in samples; ``None`` when ``rem_rank`` cannot take ``rem``."""
    off = np.zeros(a.size, dtype=np.int64)
    if rem_rank is not None:
        off[rem_rank] = rem
    lo_u = -(-(lo - off) // g)
    lo_u = np.maximum(lo_u, 0)
    hi_u = (hi - off) // g
    if np.any(hi_u < lo_u):
        return None
    units = (total - rem) // g
    if lo_u.sum() > units or hi_u.sum() < units:
        return None
    k = _water_fill(a + c * off, c * g, lo_u.astype(float), hi_u.astype(float), units)
    return off + k * g


def solve(
    a_ms: Sequence[float],
    c_ms: Sequence[float],
    global_batch_size: int,
    constraints: Constraints = NO_CONSTRAINTS,
) -> tuple[int, ...]:
    """Shares minimising the predicted step time ``max_i a_ms[i] + c_ms[i] * shares[i]``.

    Deterministic; see the module docstring for ties and granularity. Raises
    :class:`InfeasibleError` (a ``ValueError``) naming the constraint that breaks.

    >>> solve([0, 0], [1.0, 2.0], 12)
    (8, 4)
    """
    a, c = _check_costs(a_ms, c_ms)
    if not isinstance(global_batch_size, int) or global_batch_size < 0:
        raise ValueError(f"global_batch_size must be an integer >= 0, got {global_batch_size!r}.")
    n = a.size
    if n == 0:
        raise ValueError("the job has no ranks; a_ms and c_ms are empty.")
    bounds = rank_bounds(n, global_batch_size, constraints)
    shares = np.array(bounds.lo, dtype=np.int64)
    free = np.array([r for r in range(n) if r not in bounds.fixed], dtype=np.int64)
    if free.size == 0:
        return tuple(int(s) for s in shares)
    total = global_batch_size - int(sum(bounds.lo[r] for r in bounds.fixed))
    g = bounds.granularity
    lo = np.array(bounds.lo, dtype=np.int64)[free]
    hi = np.array(bounds.hi, dtype=np.int64)[free]
    af, cf = a[free], c[free]
    rem = total % g
    if rem == 0:
        best = _solve_free(af, cf, lo, hi, g, total, None, 0)
        if best is None:
            raise InfeasibleError(
                f"bounds on ranks {_ranks_text(free.tolist())} admit no split of {total} "
                f"samples into multiples of granularity {g}."
            )
    else:
        best = _best_remainder_split(af, cf, lo, hi, g, total, rem)
        if best is None:
            raise InfeasibleError(
                f"{total} samples left after pins are not a multiple of granularity {g}, and "
                f"no free rank can take the remainder {rem} within its bounds."
            )
    shares[free] = best
    return tuple(int(s) for s in shares)


def _best_remainder_split(a: np.ndarray, c: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                          g: int, total: int, rem: int) -> np.ndarray | None:
    n = a.size
    if n > _EXACT_REMAINDER_RANKS:
        fast = _fast_remainder(a, c, lo, hi, g, total, rem)
        if fast is not None:
            return fast
    if n <= _EXACT_REMAINDER_RANKS:
        candidates = list(range(n))
    else:
        # Rank by the time after adding the remainder on top of the g-multiple split.
        base = _solve_free(a, c, lo, hi, g, total - rem, None, 0)
        if base is None:
            candidates = list(range(min(n, _REMAINDER_CANDIDATES)))
        else:
            cost = a + c * (base + rem)
            cost[(base + rem) > hi] = np.inf
            candidates = np.argsort(cost, kind="stable")[:_REMAINDER_CANDIDATES].tolist()
    best: np.ndarray | None = None
    best_key: tuple | None = None
    for j in candidates:
        got = _solve_free(a, c, lo, hi, g, total, j, rem)
        if got is None:
            continue
        # Same objective as predicted_step_ms: ranks left idle do not count.
        t = np.sort((a + c * got)[got > 0])[::-1]
        key = (float(t[0]) if t.size else 0.0, tuple(t.tolist()), j)
        if best_key is None or key < best_key:
            best, best_key = got, key
    return best


def _fast_remainder(a: np.ndarray, c: np.ndarray, lo: np.ndarray, hi: np.ndarray, g: int,
                    total: int, rem: int) -> np.ndarray | None:
    """Remainder rank in O(N): exact in the step time, ties by lowest rank.

    Giving rank j the remainder raises each of its unit costs by less than one unit step,
    so against the split of the multiples alone, j either keeps its units (A) or hands
    one unit to the cheapest next unit elsewhere (B). None when that split does not exist
    (a rank can hold only the remainder, or the multiples alone are infeasible).
    """
    units = (total - rem) // g
    lo_u = -(-lo // g)
    hi_u = hi // g
    if np.any(lo_u > hi_u) or lo_u.sum() > units or hi_u.sum() < units:
        return None
    u = _water_fill(a, c * g, lo_u.astype(float), hi_u.astype(float), units)
    share = u * g
    t = np.where(share > 0, a + c * share, -np.inf)
    n = a.size
    idx = np.arange(n)
    top = int(np.argmax(t))
    rest = np.delete(t, top)
    second = float(rest.max()) if rest.size else -np.inf
    m_excl = np.where(idx == top, second, t[top])
    t_a = a + c * (share + rem)
    key_a = np.where(share + rem <= hi, np.maximum(m_excl, t_a), np.inf)
    nxt = np.where(u < hi_u, a + c * g * (u + 1), np.inf)
    low = int(np.argmin(nxt))
    rest = np.delete(nxt, low)
    second_low = float(rest.min()) if rest.size else np.inf
    n_excl = np.where(idx == low, second_low, nxt[low])
    taker = np.where(idx == low, int(np.argmin(np.where(idx == low, np.inf, nxt))), low)
    share_b = share - g + rem
    ok_b = (u >= 1) & (share_b >= lo) & np.isfinite(n_excl)
    key_b = np.where(ok_b, np.maximum(np.maximum(m_excl, a + c * share_b), n_excl), np.inf)
    best_a, best_b = int(np.argmin(key_a)), int(np.argmin(key_b))
    if not np.isfinite(key_a[best_a]) and not np.isfinite(key_b[best_b]):
        return None
    out = share.copy()
    if key_a[best_a] <= key_b[best_b]:
        out[best_a] += rem
    else:
        out[best_b] = share_b[best_b]
        out[int(taker[best_b])] += g
    return out


# Ranks whose predicted times at an even share differ by less than this fraction (or by less
# than two standard errors of the difference, when that is larger) count as equal.
TIE_TOLERANCE = 0.03


def even_ties(a_ms: Sequence[float], c_ms: Sequence[float], global_batch_size: int,
              rel_error: Sequence[float] = (),
              tolerance: float = TIE_TOLERANCE) -> tuple[list[float], list[float]]:
    """``(a_ms, c_ms)`` with ranks the fit cannot tell apart given one cost, their mean.

    Two equal cards never measure exactly alike: left to the noise, the one that happened to
    look faster takes what does not divide evenly, and the next fit hands it to the other
    (48/32, then 32/48). Ranks are compared by their predicted time at an even share
    ``B / n``; sorted by it, a rank joins the group of the fastest rank not yet grouped when
    it is within ``max(tolerance, 2 * hypot(rel_error_i, rel_error_j))`` of it (two standard
    errors of the difference). With one cost per group the
    solver's own tie rule splits the group evenly, the lower rank taking what does not
    divide: the same answer at every run.

    >>> even_ties([0.0, 0.0, 0.0], [1.0, 1.01, 2.0], 96)
    ([0.0, 0.0, 0.0], [1.005, 1.005, 2.0])
    """
    n = len(a_ms)
    a = np.asarray(a_ms, dtype=float).copy()
    c = np.asarray(c_ms, dtype=float).copy()
    if n < 2:
        return a.tolist(), c.tolist()
    t = a + c * (global_batch_size / n)
    err = np.zeros(n) if not len(rel_error) else np.asarray(rel_error, dtype=float)
    err = np.where(np.isfinite(err), err, 0.0)
    order = np.lexsort((np.arange(n), t))
    ts, es = t[order], err[order]
    widest = max(tolerance, 2.0 * math.hypot(float(es.max()), float(es.max())))
    k = 0
    while k < n:
        head = float(ts[k])
        if head <= 0:
            k += 1
            continue
        # Only ranks within the widest tolerance can join: look no further than that.
        stop = int(np.searchsorted(ts, head * (1.0 + widest), side="right"))
        tol = np.maximum(tolerance, 2.0 * np.hypot(es[k], es[k + 1:stop]))  # two sigma of the difference
        outside = np.flatnonzero(ts[k + 1:stop] > head * (1.0 + tol))
        j = k + 1 + (int(outside[0]) if outside.size else stop - k - 1)
        if j - k > 1:
            group = order[k:j]
            a[group], c[group] = a[group].mean(), c[group].mean()
        k = j
    return a.tolist(), c.tolist()


def predicted_step_ms(a_ms: Sequence[float], c_ms: Sequence[float],
                      shares: Sequence[int]) -> float:
    """Predicted step compute time ``max_i a_i + c_i * b_i`` over ranks with work.

    Ranks with share 0 run a zero-weight dummy step whose cost no split changes, so they
    are left out; 0.0 when no rank has work.
    """
    if not (len(a_ms) == len(c_ms) == len(shares)):
        raise ValueError(
            f"a_ms, c_ms and shares must have one value per rank, got {len(a_ms)}, "
            f"{len(c_ms)} and {len(shares)}."
        )
    times = [a + c * b for a, c, b in zip(a_ms, c_ms, shares, strict=True) if b > 0]
    return float(max(times)) if times else 0.0

"""Numbers drawn from a run's per-step times: steady state, convergence, excess time.

Pure functions on lists of floats, so the smoke tests can check them exactly.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

__all__ = [
    "steady_ms",
    "rolling_median",
    "steps_until_within",
    "steps_until_split_within",
    "shares_at",
    "excess_ms",
    "split_excess_ms",
    "oracle_shares",
    "static_shares",
    "model_step_ms",
]


def steady_ms(step_ms: Sequence[float], tail_fraction: float = 0.3, min_tail: int = 10) -> float:
    """Median step time over the last ``tail_fraction`` of the run (at least ``min_tail`` steps).

    The median, not the mean: on a shared 2-core machine single steps spike when another
    process gets scheduled, and one spike says nothing about the split.
    """
    if not step_ms:
        raise ValueError("steady_ms needs at least one step time, got none.")
    n = max(min_tail, int(len(step_ms) * tail_fraction))
    return float(statistics.median(step_ms[-n:]))


def rolling_median(values: Sequence[float], window: int) -> list[float]:
    """Median of ``values[k:k+window]`` for every k with a full window."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}.")
    return [float(statistics.median(values[k:k + window])) for k in range(len(values) - window + 1)]


def steps_until_within(
    step_ms: Sequence[float],
    reference_ms: float | Callable[[int], float],
    tolerance: float,
    *,
    start: int = 0,
    window: int = 10,
    settled: float = 0.9,
) -> int | None:
    """Steps after ``start`` until the measured step time settles within ``tolerance`` of
    the reference.

    Returns the smallest ``k - start`` (k >= start) such that the window at k is good and at
    least ``settled`` of the windows from k on are good, a window being good when the median
    of its ``window`` step times is at most ``(1 + tolerance)`` times the reference at its
    first step; None when the run never settles there.
    """
    ref = reference_ms if callable(reference_ms) else (lambda _k, r=reference_ms: r)
    med = rolling_median(step_ms, window)
    ok = [m <= (1.0 + tolerance) * ref(k) for k, m in enumerate(med)]
    if len(ok) <= start:
        return None
    # From k on, at least `settled` of the windows must be good: a neighbour's burst of load
    # may lift a few windows above the line, a split that is off lifts nearly all of them.
    bad_after = 0
    first: int | None = None
    for k in range(len(ok) - 1, start - 1, -1):
        bad_after += not ok[k]
        if ok[k] and bad_after <= (1.0 - settled) * (len(ok) - k):
            first = k
    return None if first is None else first - start


def shares_at(timeline: Sequence[dict[str, object]], step: int, world_size: int,
              global_batch_size: int) -> list[int]:
    """The shares in force at ``step`` from a job's placement timeline
    (``[{"version", "start_batch", "shares"}, ...]``); the even split before the first."""
    best: list[int] | None = None
    start = -1
    for p in timeline:
        b = int(p["start_batch"])  # type: ignore[call-overload]
        if start < b <= step:
            best, start = list(p["shares"]), b  # type: ignore[call-overload]
    if best is None:
        q, r = divmod(global_batch_size, world_size)
        best = [q + (1 if i < r else 0) for i in range(world_size)]
    return best


def steps_until_split_within(
    timeline: Sequence[dict[str, object]],
    costs_at: Callable[[int], tuple[list[float], list[float]]],
    n_steps: int,
    global_batch_size: int,
    tolerance: float,
    *,
    start: int = 0,
) -> int | None:
    """Steps after ``start`` until the split in force stays within ``tolerance`` of the best
    split for the true costs, judged by the model ``max_i a_i + c_i * b_i`` at every step.

    Noise-free: it reads which shares each batch ran with, not how long the machine took,
    so it measures the policy, not the neighbours' load. None when it never settles.
    """
    ok = []
    for k in range(n_steps):
        a, c = costs_at(k)
        best = model_step_ms(a, c, oracle_shares(a, c, global_batch_size))
        now = model_step_ms(a, c, shares_at(timeline, k, len(a), global_batch_size))
        ok.append(now <= (1.0 + tolerance) * best)
    if len(ok) <= start or not ok[-1]:
        return None
    k = len(ok) - 1
    while k > start and ok[k - 1]:
        k -= 1
    return k - start


def excess_ms(
    step_ms: Sequence[float],
    reference_ms: float | Callable[[int], float],
    start: int = 0,
    stop: int | None = None,
) -> float:
    """Time paid above the reference over steps ``[start, stop)``: sum of max(0, t - ref)."""
    ref = reference_ms if callable(reference_ms) else (lambda _k, r=reference_ms: r)
    stop = len(step_ms) if stop is None else min(stop, len(step_ms))
    return float(sum(max(0.0, step_ms[k] - ref(k)) for k in range(start, stop)))


def split_excess_ms(
    timeline: Sequence[dict[str, object]],
    costs_at: Callable[[int], tuple[list[float], list[float]]],
    n_steps: int,
    global_batch_size: int,
    *,
    start: int = 0,
) -> float:
    """Time the split in force costs above the best split for the true costs over steps
    ``[start, n_steps)``, by the model ``max_i a_i + c_i * b_i``: ``excess_ms`` without the
    machine's noise (on a loaded machine, summing ``max(0, t - ref)`` over measured steps
    adds every upward wobble, whatever the split)."""
    total = 0.0
    for k in range(start, n_steps):
        a, c = costs_at(k)
        total += model_step_ms(a, c, shares_at(timeline, k, len(a), global_batch_size)) - \
            model_step_ms(a, c, oracle_shares(a, c, global_batch_size))
    return total


def oracle_shares(a_ms: Sequence[float], c_ms: Sequence[float], global_batch_size: int) -> list[int]:
    """The best split for the true costs, from the product's own exact solver."""
    from backend.policy import solve  # the policy engineer's solver (imported late: no torch)
    from backend.policy.types import Constraints

    return list(solve(list(a_ms), list(c_ms), global_batch_size, Constraints()))


def static_shares(speeds: Sequence[float], global_batch_size: int) -> list[int]:
    """The static strategy's split (backend.policy.strategies.static_shares) when each rank's
    relative device power is known and equals its injected speed."""
    from backend.policy.strategies import static_shares as product_static_shares

    names = [f"bench-device-{i}" for i in range(len(speeds))]
    return list(product_static_shares(names, global_batch_size, "custom",
                                      dict(zip(names, speeds, strict=True))))


def model_step_ms(a_ms: Sequence[float], c_ms: Sequence[float], shares: Sequence[int]) -> float:
    """Slowest rank's compute time for ``shares`` under ``t_i(b) = a_i + c_i * b``."""
    return max(a + c * b for a, c, b in zip(a_ms, c_ms, shares, strict=True))

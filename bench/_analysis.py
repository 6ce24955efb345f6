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
    "excess_ms",
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
) -> int | None:
    """Steps after ``start`` until the step time stays within ``tolerance`` of the reference.

    Returns the smallest ``k - start`` (k >= start) such that for every later window, the
    median of ``window`` consecutive step times is at most ``(1 + tolerance)`` times the
    reference at that window's first step; None when the run never settles there. A rolling
    median ignores single scheduling spikes but not a split that is really off.
    """
    ref = reference_ms if callable(reference_ms) else (lambda _k, r=reference_ms: r)
    med = rolling_median(step_ms, window)
    ok = [m <= (1.0 + tolerance) * ref(k) for k, m in enumerate(med)]
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

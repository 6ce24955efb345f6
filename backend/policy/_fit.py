"""Robust fits used by the strategies: t(b) = a + c*b per rank, and trends over steps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .types import StepSample

# 1.4826 * MAD estimates a standard deviation under normal noise.
_MAD_SIGMA = 1.4826


@dataclass(frozen=True, slots=True)
class LinearFit:
    a_ms: float
    c_ms: float
    n: int
    r2: float | None  # None when all samples sit at one batch size (no spread to explain)
    rel_noise: float  # robust relative spread of the residuals (sigma / level)
    method: str  # "theil-sen" | "proportional"
    restarted: bool = False  # the window was cut at a detected level shift


def valid_steps(steps: Sequence[StepSample], window: int) -> list[StepSample]:
    """The most recent ``window`` steps with work and a finite, positive time."""
    good = [s for s in steps
            if s.local_batch_size > 0 and math.isfinite(s.compute_ms) and s.compute_ms > 0]
    return good[-window:] if window > 0 else good


def theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float] | None:
    """Median of pairwise slopes and the matching intercept; None without x spread."""
    dx = x[None, :] - x[:, None]
    dy = y[None, :] - y[:, None]
    mask = np.triu(dx != 0, k=1)
    if not mask.any():
        return None
    slope = float(np.median(dy[mask] / dx[mask]))
    return slope, float(np.median(y - slope * x))


def fit_steps(samples: Sequence[StepSample], *, min_spread: float = 0.1,
              shift_threshold: float = 0.1, recent: int = 10) -> LinearFit:
    """Fit ``compute_ms = a + c * local_batch_size`` robustly.

    Theil-Sen when the batch sizes spread by at least ``min_spread`` (relative); otherwise
    the fixed cost is not identifiable and the fit is proportional (a = 0, c = median time
    per sample). If the last ``recent`` steps sit off the fit by more than
    ``shift_threshold`` in the same direction, the rank's speed changed: refit on them.
    """
    b = np.array([s.local_batch_size for s in samples], dtype=float)
    t = np.array([s.compute_ms for s in samples], dtype=float)
    fit = _fit_arrays(b, t, min_spread)
    if recent and b.size >= 2 * recent:
        pred = fit.a_ms + fit.c_ms * b[-recent:]
        rel = (t[-recent:] - pred) / np.maximum(pred, 1e-9)
        med = float(np.median(rel))
        same_side = float(np.mean(np.sign(rel) == np.sign(med)))
        # On a noisy rank the median of a few steps wanders by itself: ask for 3 of its
        # standard errors as well as the fixed threshold.
        threshold = max(shift_threshold, 3.0 * 1.25 * fit.rel_noise / math.sqrt(recent))
        if abs(med) > threshold and same_side >= 0.8:
            return _restart(b, t, fit, threshold, recent, min_spread)
    return fit


def _restart(b: np.ndarray, t: np.ndarray, old: LinearFit, threshold: float, recent: int,
             min_spread: float) -> LinearFit:
    """Refit on the steps since the speed changed."""
    pred = old.a_ms + old.c_ms * b
    rel = (t - pred) / np.maximum(pred, 1e-9)
    sign = 1.0 if np.median(rel[-recent:]) > 0 else -1.0
    start = b.size - recent
    # Walk back while steps still sit on the new side: the change may be older than
    # ``recent`` steps.
    while start > 0 and sign * rel[start - 1] > threshold:
        start -= 1
    fit = _fit_arrays(b[start:], t[start:], min_spread)
    return LinearFit(fit.a_ms, fit.c_ms, fit.n, fit.r2, fit.rel_noise, fit.method, True)


def _fit_arrays(b: np.ndarray, t: np.ndarray, min_spread: float) -> LinearFit:
    n = int(b.size)
    if n == 0:
        return LinearFit(0.0, 0.0, 0, None, 0.0, "none")
    spread = (b.max() - b.min()) / max(b.max(), 1.0)
    a = c = None
    method = "proportional"
    if spread >= min_spread:
        got = theil_sen(b, t)
        if got is not None:
            c_ts, a_ts = got
            # A negative slope or an overhead above the fastest step is noise, not physics.
            if c_ts > 0 and 0 <= a_ts <= float(t.min()):
                c, a, method = c_ts, a_ts, "theil-sen"
    if c is None or a is None:
        a = 0.0
        c = float(np.median(t / b))
    pred = a + c * b
    resid = t - pred
    level = float(np.median(pred)) or 1.0
    rel_noise = _MAD_SIGMA * float(np.median(np.abs(resid - np.median(resid)))) / level
    r2: float | None = None
    if method == "theil-sen":
        ss_tot = float(((t - t.mean()) ** 2).sum())
        r2 = 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else None
    return LinearFit(float(a), float(c), n, r2, rel_noise, method)


def robust_trend(x: Sequence[float] | np.ndarray,
                 y: Sequence[float] | np.ndarray) -> tuple[float, float] | None:
    """Theil-Sen slope and intercept of ``y`` over ``x`` (None with fewer than 3 points)."""
    if len(x) < 3:
        return None
    return theil_sen(np.asarray(x, dtype=float), np.asarray(y, dtype=float))

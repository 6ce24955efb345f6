"""Robust fits used by the strategies: t(b) = a + c*b per rank, and trends over steps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.ma  # noqa: F401  np.median imports it on first use: pay that at import, not in a timed policy run

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
    start: int = 0  # index of the first step used in the samples given (after a cut)


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


# CUSUM on residuals in noise units, each clipped to +-_Z_CLIP: a single step, however far
# off (a checkpoint write, a GC pause), adds at most _Z_CLIP - _ALLOW and then decays, so a
# level shift needs _SHIFT_STEPS steps in a row off the fit. Noise below _NOISE_FLOOR is
# not trusted (CPU timers, a few steps).
_Z_CLIP = 4.0
_ALLOW = 1.0
_ALARM = 8.0
_NOISE_FLOOR = 0.02
SHIFT_STEPS = 3  # steps off the fit that make a level shift (8 / (4 - 1) rounded up)


def detect_shift(rel: np.ndarray, noise: float, threshold: float = 0.1) -> int | None:
    """Start of the newest level shift in relative residuals ``rel`` (oldest first), or None.

    Two-sided CUSUM of ``clip(rel / noise, +-4) - 1``, alarm at 8: three steps in a row
    well off the fit, never one. A shift smaller than ``threshold`` (relative) is not one:
    it has to clear the noise and the threshold both. When the deviating run starts at the
    first step, the older steps are the odd ones out and the new level starts where the run
    peaked.
    """
    n = int(rel.size)
    if n < SHIFT_STEPS:
        return None
    s = max(noise, _NOISE_FLOOR)
    # Residuals below the threshold count as noise: scale so the threshold is 2 sigma at least.
    s = max(s, threshold / 2.0)
    z = np.clip(rel / s, -_Z_CLIP, _Z_CLIP)
    found: int | None = None
    for sign in (1.0, -1.0):
        acc, start, peak, peak_at = 0.0, 0, 0.0, -1
        alarm_start = alarm_peak = None
        for k in range(n):
            acc = max(0.0, acc + sign * float(z[k]) - _ALLOW)
            if acc == 0.0:
                start, peak, peak_at = k + 1, 0.0, -1
                continue
            if acc > peak:
                peak, peak_at = acc, k
            if acc >= _ALARM:
                alarm_start, alarm_peak = start, peak_at
        if alarm_start is None or alarm_peak is None:
            continue
        if alarm_start == 0:
            cut = alarm_peak + 1 if acc == 0.0 or alarm_peak < n - 1 else None
            if cut is None or cut >= n:
                continue
        else:
            cut = alarm_start
        found = cut if found is None else max(found, cut)
    return found


def fit_steps(samples: Sequence[StepSample], *, min_spread: float = 0.1,
              shift_threshold: float = 0.1, recent: int = 10) -> LinearFit:
    """Fit ``compute_ms = a + c * local_batch_size`` robustly.

    Theil-Sen when the batch sizes spread by at least ``min_spread`` (relative); otherwise
    the fixed cost is not identifiable and the fit is proportional (a = 0, c = median time
    per sample). A level shift (``detect_shift``: three steps in a row off the fit by more
    than ``shift_threshold`` and the noise) means the rank's speed changed: refit on the
    steps since, and look again (at most three times). ``recent`` is kept for callers; the
    shift test needs only three steps.
    """
    b = np.array([s.local_batch_size for s in samples], dtype=float)
    t = np.array([s.compute_ms for s in samples], dtype=float)
    fit = _fit_arrays(b, t, min_spread)
    start, restarted = 0, False
    for _ in range(3):
        if b.size - start < 2 * SHIFT_STEPS:
            break
        pred = fit.a_ms + fit.c_ms * b[start:]
        rel = (t[start:] - pred) / np.maximum(pred, 1e-9)
        cut = detect_shift(rel, fit.rel_noise, shift_threshold)
        if cut is None or cut == 0:
            break
        start += cut
        restarted = True
        fit = _fit_arrays(b[start:], t[start:], min_spread)
    if restarted:
        fit = LinearFit(fit.a_ms, fit.c_ms, fit.n, fit.r2, fit.rel_noise, fit.method, True,
                        start)
    return fit


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

"""Strategies: from a job observation to per-rank cost estimates ``t_i(b) = a_i + c_i*b``.

A strategy is a callable ``(obs, config, constraints) -> Estimate | NoProposal`` (or a class
whose instances are such callables, or have an ``estimate`` method), registered by name.
The engine (``engine.decide``) turns an estimate into a proposal.

One module, over 400 lines on purpose: the strategy registry and the built-in strategies
(static, profiled, predictive), which share the estimate type and its fitting helpers."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._fit import SHIFT_STEPS, LinearFit, fit_steps, robust_trend, valid_steps
from .devices import SLOWDOWN_REASONS, device_weights
from .solver import NO_CONSTRAINTS, solve
from .types import Constraints, DeviceSignals, JobObservation, NoProposal, PolicyConfig

__all__ = [
    "Estimate",
    "Strategy",
    "register_strategy",
    "get_strategy",
    "available_strategies",
    "static_shares",
    "static_strategy",
    "profiled_strategy",
    "predictive_strategy",
]


@dataclass(frozen=True, slots=True)
class Estimate:
    """Per-rank cost model a strategy hands to the engine."""

    a_ms: tuple[float, ...]
    c_ms: tuple[float, ...]
    units: str = "ms"  # "relative" when no measurement sets the scale (static at start)
    fit_r2: tuple[float | None, ...] = ()
    n_steps: tuple[int, ...] = ()
    # Relative standard error of each rank's predicted time: the engine asks for a gain
    # that clears this noise, so estimates that merely wobble never trigger a change.
    rel_error: tuple[float, ...] = ()
    evidence: dict[str, object] = field(default_factory=dict)
    # Ranks the engine keeps at their current share: no evidence to move them on.
    hold: tuple[int, ...] = ()


Strategy = Callable[[JobObservation, PolicyConfig, Constraints], "Estimate | NoProposal"]
_REGISTRY: dict[str, Callable[[], Strategy]] = {}


def register_strategy(name: str, fn_or_cls: Any) -> None:
    """Register a strategy under ``name`` (replacing any earlier one of that name).

    ``fn_or_cls`` is a function ``(obs, config, constraints) -> Estimate | NoProposal``, or
    a class built with no arguments whose instances are such callables or have an
    ``estimate(obs, config, constraints)`` method.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"strategy name must be a non-empty string, got {name!r}.")
    if isinstance(fn_or_cls, type):
        cls = fn_or_cls
        if not (callable(getattr(cls, "estimate", None)) or "__call__" in vars(cls)):
            raise ValueError(f"strategy class {cls.__name__} needs __call__ or estimate().")

        def make() -> Strategy:
            inst = cls()
            return inst.estimate if hasattr(inst, "estimate") else inst

        _REGISTRY[name] = make
    elif callable(fn_or_cls):
        fn = fn_or_cls
        _REGISTRY[name] = lambda: fn
    else:
        raise ValueError(
            f"strategy {name!r} must be a function or a class, got {type(fn_or_cls).__name__}."
        )


def get_strategy(name: str) -> Strategy:
    """The strategy registered as ``name``; ``ValueError`` listing the choices otherwise."""
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(
            f"unknown strategy {name!r}; available: {', '.join(available_strategies())}."
        ) from None


def available_strategies() -> list[str]:
    """Names of the registered strategies, sorted."""
    return sorted(_REGISTRY)


# ---------------------------------------------------------------- static


def static_shares(
    device_types: Sequence[str | None],
    global_batch_size: int,
    workload: str = "llm",
    custom_weights: Mapping[str, float] | None = None,
    constraints: Constraints = NO_CONSTRAINTS,
) -> tuple[int, ...]:
    """Split ``global_batch_size`` in proportion to device power for ``workload``.

    >>> static_shares(["H100", "H100", "A100-80GB", "A100-80GB"], 256)
    (93, 93, 35, 35)
    """
    weights, _ = device_weights(device_types, workload, custom_weights)
    return solve([0.0] * len(weights), [1.0 / w for w in weights], global_batch_size,
                 constraints)


def static_strategy(obs: JobObservation, config: PolicyConfig,
                    constraints: Constraints) -> Estimate:
    """Device table x workload profile; needs no measurement."""
    weights, warnings = device_weights(
        [r.device_type for r in obs.ranks], config.workload, config.custom_weights
    )
    # Measured steps, when there are any, only set the scale so times read in ms.
    per_sample: list[float] = []
    for r, w in zip(obs.ranks, weights, strict=True):
        steps = valid_steps(r.steps, config.window_steps)
        if steps:
            per_sample.append(float(np.median([s.compute_ms / s.local_batch_size
                                               for s in steps])) * w)
    units = "ms" if per_sample else "relative"
    scale = float(np.median(per_sample)) if per_sample else 1.0
    return Estimate(
        a_ms=tuple(0.0 for _ in weights),
        c_ms=tuple(scale / w for w in weights),
        units=units,
        n_steps=tuple(0 for _ in weights),
        rel_error=tuple(0.0 for _ in weights),
        evidence={"workload": config.workload, "weights": [round(w, 3) for w in weights],
                  "warnings": warnings},
    )


# ---------------------------------------------------------------- profiled


def _fits(obs: JobObservation, config: PolicyConfig) -> list[LinearFit | None]:
    p = config.params
    out: list[LinearFit | None] = []
    for r in obs.ranks:
        steps = valid_steps(r.steps, config.window_steps)
        out.append(fit_steps(
            steps,
            min_spread=float(p.get("min_spread", 0.1)),
            shift_threshold=float(p.get("shift_threshold", 0.1)),
            recent=max(int(config.min_steps), 3),
        ) if steps else None)
    return out


# Early readiness: relative standard error at most this fraction of min_gain.
_EARLY_SE = 0.25


# After a restart, below this many steps the residuals' spread says little about the noise: assume
# at least _SMALL_N_NOISE (3%, CPU and GPU step times alike) so a lucky streak of a few
# steps is not taken for a precise estimate.
_SMALL_N = 10
_SMALL_N_NOISE = 0.03


def _rel_error(fit: LinearFit) -> float:
    # Standard error of a median-based level: 1.25 sigma / sqrt(n).
    if fit.n <= 0:
        return math.inf
    noise = max(fit.rel_noise, _SMALL_N_NOISE) if fit.restarted and fit.n < _SMALL_N \
        else fit.rel_noise
    return 1.25 * noise / math.sqrt(fit.n)


def _ready_early(fit: LinearFit | None, config: PolicyConfig) -> bool:
    """Half of ``min_steps`` (at least 3) is enough for a rank whose estimate is already
    tight: relative standard error within a quarter of ``min_gain`` (1.25% by default), so
    the first split lands within about two of them (2.5%) of the best one. A rank with 3%
    step-time noise (1.7% at 5 steps) waits for ``min_steps``, a steady one (~1%) does not.
    After a confirmed level shift (``SHIFT_STEPS`` steps at the new level) a rank is ready
    at once."""
    early = max(3, -(-config.min_steps // 2))
    if fit is None:
        return False
    if fit.restarted and fit.n >= SHIFT_STEPS:
        # A confirmed level shift on a rank measured before: act on the steps since (their
        # standard error widens the plan margin and the gain threshold instead).
        return True
    return fit.n >= early and _rel_error(fit) <= _EARLY_SE * config.min_gain


def profiled_strategy(obs: JobObservation, config: PolicyConfig,
                      constraints: Constraints) -> Estimate | NoProposal:
    """Robust per-rank fit of measured compute time against local batch size.

    Warming up until every working rank has ``min_steps`` valid steps, or half as many
    when its fit is already tight (see ``_ready_early``).
    """
    fits = _fits(obs, config)
    short: list[tuple[int, int]] = []  # (missing steps, rank)
    for rank, (r, fit) in enumerate(zip(obs.ranks, fits, strict=True)):
        fixed = rank in constraints.drains or rank in constraints.pins
        if fixed or (obs.shares[rank] == 0 and fit is None):
            continue  # nothing to learn: its share is set, or it gets no work to measure
        have = fit.n if fit is not None else 0
        if have < config.min_steps and not _ready_early(fit, config):
            short.append((config.min_steps - have, r.rank))
    if short:
        missing, rank = max(short)
        more = f" ({len(short)} ranks short)" if len(short) > 1 else ""
        return NoProposal("warming_up",
                          f"warming up: {missing} more steps needed on rank {rank}{more}",
                          steps_remaining=missing)
    known = [f for f in fits if f is not None and f.n > 0]
    if not known:
        return NoProposal("no_data", "no valid steps measured on any rank yet")
    # A rank with no samples borrows the median cost only where that changes nothing (its
    # share is pinned or drained). An idle rank (share 0) without a measured step keeps
    # share 0: assuming the median for it handed a very slow rank work back, which auto
    # mode rolled back, again and again (issue 13). Its last measured steps, however old,
    # are its cost (the controller keeps them in the window).
    med_a = float(np.median([f.a_ms for f in known]))
    med_c = float(np.median([f.c_ms for f in known]))
    a: list[float] = []
    c: list[float] = []
    r2: list[float | None] = []
    n: list[int] = []
    err: list[float] = []
    borrowed: list[int] = []
    idle: list[int] = []
    for rank, fit in enumerate(fits):
        if fit is None or fit.n == 0:
            a.append(med_a)
            c.append(med_c)
            r2.append(None)
            n.append(0)
            err.append(0.0)
            borrowed.append(rank)
            if rank not in constraints.drains and rank not in constraints.pins:
                idle.append(rank)
            continue
        a.append(fit.a_ms)
        c.append(fit.c_ms)
        r2.append(fit.r2)
        n.append(fit.n)
        err.append(_rel_error(fit))
    evidence: dict[str, object] = {
        "steps_used": n,
        "fit": [{"rank": i, "method": f.method, "r2": f.r2, "rel_noise": round(f.rel_noise, 4),
                 "restarted": f.restarted} for i, f in enumerate(fits) if f is not None],
    }
    shifts = {i: valid_steps(obs.ranks[i].steps, config.window_steps)[f.start].batch_index
              for i, f in enumerate(fits) if f is not None and f.restarted and f.n > 0}
    if shifts:
        evidence["shift_at"] = shifts  # rank -> first batch index at its new level
    if borrowed:
        evidence["median_for_ranks"] = borrowed
    if idle:
        evidence["idle_without_evidence"] = idle
    return Estimate(tuple(a), tuple(c), "ms", tuple(r2), tuple(n), tuple(err), evidence,
                    hold=tuple(idle))


# ---------------------------------------------------------------- predictive

_MAD = 1.4826


def _finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


def _device_forecast(dev: Sequence[DeviceSignals], horizon_s: float, temp_limit_c: float,
                     temp_penalty: float) -> dict[str, Any]:
    """Expected slow-down factor of per-sample cost over the horizon from device signals."""
    out: dict[str, Any] = {"factor": 1.0}
    if not dev:
        return out
    last = dev[-1]
    reasons = sorted(set(last.throttle_reasons) & SLOWDOWN_REASONS)
    if reasons:
        out["throttle"] = reasons
    clocks = [(d.t, d.sm_clock_mhz, d.sm_clock_max_mhz) for d in dev[-60:]
              if d.sm_clock_mhz and d.sm_clock_max_mhz and _finite(d.t, d.sm_clock_mhz,
                                                                     d.sm_clock_max_mhz)]
    if len(clocks) >= 3:
        ts = [x[0] for x in clocks]
        mhz = [x[1] for x in clocks]
        peak = float(clocks[-1][2])
        trend = robust_trend(ts, mhz)
        if trend is not None:
            slope, icpt = trend
            now = min(max(icpt + slope * ts[-1], 0.3 * peak), peak)
            # Only a falling clock with a throttle reason, or a clear fall, is a forecast;
            # boost clocks wander a little by design.
            falling = slope < 0 and (reasons or now < 0.97 * peak)
            if falling:
                ahead = min(max(now + slope * horizon_s, 0.3 * peak), peak)
                out["factor"] = now / ahead
            out["clock_ratio"] = round(now / peak, 4)
    temps = [(d.t, d.temp_c) for d in dev[-60:]
             if d.temp_c is not None and _finite(d.t, d.temp_c)]
    if len(temps) >= 3:
        trend = robust_trend([x[0] for x in temps], [x[1] for x in temps])
        if trend is not None:
            slope, icpt = trend
            now_c = icpt + slope * temps[-1][0]
            ahead_c = now_c + slope * horizon_s
            out["temp_c"] = round(now_c, 1)
            # A card that runs hot but steady is not a forecast: ask for a real climb.
            climbing = temps[-1][1] - temps[0][1] >= 2.0 and slope * horizon_s >= 1.0
            if climbing and ahead_c >= temp_limit_c and out["factor"] <= 1.0:
                # Heading into the slowdown temperature, clocks not yet down: expect it.
                out["factor"] = 1.0 + temp_penalty
                out["temp_warning"] = f"temperature heading to {ahead_c:.0f} C"
    return out


_TREND_MIN = 8  # steps: the shortest segment a trend is fitted on
_TREND_LENGTHS = (200, 100, 60, 40, 30, 24, 20, 16, 12, _TREND_MIN)


@dataclass(frozen=True, slots=True)
class _Trend:
    slope: float  # per-sample cost per step
    level: float  # per-sample cost at the last step, on the line
    significant: bool
    n: int  # steps in the segment
    rel_se: float  # relative standard error of ``level``


def _cost_trend(steps: Sequence[Any], a: float, since_shift: int = 0,
                min_window: int = 2 * _TREND_MIN) -> _Trend | None:
    """The per-sample cost's trend: a line over the newest steps, flat before them.

    A drift that started inside the window is a hinge: flat, then a ramp. Each candidate
    length of the newest segment (``_TREND_LENGTHS``, the whole window, and the steps since
    a detected shift) is scored by the absolute residuals of "median level before it, a
    Theil-Sen line over it"; the best one wins, the longer one on a near tie (within 3%).
    The slope counts when it is three standard errors from zero (four when a segment
    shorter than the window was picked: picking the best of several flatters the fit).
    No trend from fewer than ``min_window`` steps in all.
    """
    n = len(steps)
    if n < max(_TREND_MIN, min_window):
        return None
    xs = np.array([float(s.batch_index) for s in steps])
    ys = np.array([max(s.compute_ms - a, 0.0) / s.local_batch_size for s in steps])
    lengths = {min(length, n) for length in _TREND_LENGTHS} | {since_shift}
    best: tuple[float, int, float, float] | None = None  # (cost, m, slope, icpt)
    for m in sorted((m for m in lengths if m >= _TREND_MIN), reverse=True):
        got = robust_trend(xs[-m:], ys[-m:])
        if got is None:
            continue
        slope, icpt = got
        cost = float(np.abs(ys[-m:] - (icpt + slope * xs[-m:])).sum())
        if m < n:
            head = ys[:-m]
            cost += float(np.abs(head - np.median(head)).sum())
        if best is None or cost < 0.97 * best[0]:
            best = (cost, m, slope, icpt)
    if best is None:
        return None
    _, m, slope, icpt = best
    xa, ya = xs[-m:], ys[-m:]
    resid = ya - (icpt + slope * xa)
    # The picked segment is the one whose residuals looked smallest: take the noise from
    # successive differences of the whole window as well, which no pick can flatter.
    noise = _MAD * float(np.median(np.abs(np.diff(ys)))) / math.sqrt(2.0)
    sigma = max(_MAD * float(np.median(np.abs(resid - np.median(resid)))), noise)
    spread = float(np.sqrt(((xa - xa.mean()) ** 2).sum())) or 1.0
    level = icpt + slope * float(xa[-1])
    if level <= 0:
        return None
    k_se = 3.0 if m == n else 4.0
    return _Trend(slope=slope, level=level,
                  significant=abs(slope) > k_se * 1.25 * max(sigma, 1e-12) / spread,
                  n=m, rel_se=1.25 * 2.0 * sigma / math.sqrt(m) / level)


def predictive_strategy(obs: JobObservation, config: PolicyConfig,
                        constraints: Constraints) -> Estimate | NoProposal:
    """Profiled fit, pushed ``horizon_steps`` ahead by each rank's trend and device signals.

    Per rank, the forecast per-sample cost is the larger of: the robust trend of measured
    cost extrapolated to the job's batch index plus the horizon (when the trend is
    significant, however young), and the cost scaled
    by how far the SM clock is expected to fall (a falling clock with a thermal or power
    clock-event reason, or below 97% of max). A temperature climbing to ``temp_limit_c``
    within the horizon, clocks still up, adds ``temp_penalty``. ``config.params``:
    ``step_s`` (seconds per step, default: slowest rank's median compute time),
    ``temp_limit_c`` (83), ``temp_penalty`` (0.1).
    """
    base = profiled_strategy(obs, config, constraints)
    if isinstance(base, NoProposal):
        return base
    p = config.params
    h = float(config.horizon_steps)
    medians = [float(np.median([s.compute_ms for s in valid_steps(r.steps, config.window_steps)]))
               for r in obs.ranks if valid_steps(r.steps, config.window_steps)]
    step_s = float(p.get("step_s", max(medians) / 1000.0 if medians else 0.1))
    temp_limit = float(p.get("temp_limit_c", 83.0))
    c_new = list(base.c_ms)
    a_new = list(base.a_ms)
    err = list(base.rel_error) if base.rel_error else [0.0] * len(c_new)
    forecasts = []
    for i, r in enumerate(obs.ranks):
        n = base.n_steps[i] if base.n_steps else 0
        if n < 3:
            continue
        window = valid_steps(r.steps, config.window_steps)
        a = base.a_ms[i]
        c_now = base.c_ms[i]
        c_trend = c_now
        info: dict[str, Any] = {"rank": r.rank}
        # A ramp (drift) makes the profiled fit restart its window just like a jump does;
        # the trend over the longest segment a line fits tells them apart.
        # The batch size changes only with the placement, in blocks: a drift across such a
        # change makes a + c*b confound the two (a large a, a small c, a rank that seems
        # not to care how much work it gets). Unless the sizes interleave, the trend is of
        # time per sample (a = 0), which overstates the marginal cost a little: the safe side.
        switches = sum(1 for x, y in zip(window, window[1:], strict=False)
                       if x.local_batch_size != y.local_batch_size)
        a_trend = a if switches >= len(window) // 4 else 0.0
        trend = _cost_trend(window, a_trend, n if n < len(window) else 0, 2 * config.min_steps)
        if trend is not None and trend.significant:
            c_now = trend.level
            # From the rank's newest step to the job's batch index plus the horizon: the
            # placement lives from there on, and the rank's last frame may trail the batch
            # index by the metrics batching (up to 5 steps). Over the whole horizon, however
            # young the trend: capped at twice the trend's segment, a drift significant 8
            # steps in (a CPU job's 1% timing noise) was forecast 16 steps ahead, and the
            # split fell 10% behind it before the cooldown let the next placement land
            # (issue 13). The significance test (four standard errors on a segment shorter
            # than the window) keeps noise from being extrapolated.
            behind = max(0, obs.batch_index - window[-1].batch_index)
            c_trend = max(c_now + trend.slope * (behind + h), 0.5 * c_now)
            a_new[i] = a_trend
            info["trend_per_step"] = trend.slope
            info["trend_steps"] = trend.n
            err[i] = trend.rel_se
        dev = _device_forecast(r.device, h * step_s, temp_limit,
                               float(p.get("temp_penalty", 0.1)))
        c_dev = c_now * float(dev["factor"])
        c_pred = max(c_trend, c_dev)
        if c_pred != base.c_ms[i]:
            info.update({"c_fit": round(base.c_ms[i], 6), "c_forecast": round(c_pred, 6)})
        info.update({k: v for k, v in dev.items() if k != "factor"})
        if dev["factor"] != 1.0:
            info["device_factor"] = round(float(dev["factor"]), 4)
        if len(info) > 1:
            forecasts.append(info)
        c_new[i] = c_pred
    evidence = dict(base.evidence)
    evidence.update({"horizon_steps": config.horizon_steps, "forecasts": forecasts})
    return Estimate(tuple(a_new), tuple(c_new), base.units, base.fit_r2, base.n_steps,
                    tuple(err), evidence, base.hold)


register_strategy("static", static_strategy)
register_strategy("profiled", profiled_strategy)
register_strategy("predictive", predictive_strategy)

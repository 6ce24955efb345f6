"""Strategies: from a job observation to per-rank cost estimates ``t_i(b) = a_i + c_i*b``.

A strategy is a callable ``(obs, config, constraints) -> Estimate | NoProposal`` (or a class
whose instances are such callables, or have an ``estimate`` method), registered by name.
The engine (``engine.decide``) turns an estimate into a proposal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._fit import LinearFit, fit_steps, robust_trend, valid_steps
from .devices import THROTTLE_REASONS, device_weights
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


def _rel_error(fit: LinearFit) -> float:
    # Standard error of a median-based level: 1.25 sigma / sqrt(n).
    return 1.25 * fit.rel_noise / math.sqrt(fit.n) if fit.n > 0 else math.inf


def _ready_early(fit: LinearFit | None, config: PolicyConfig) -> bool:
    """Half of ``min_steps`` (at least 3) is enough for a rank whose estimate is already
    tight: relative standard error within a quarter of ``min_gain`` (1.25% by default), so
    the first split lands within about two of them (2.5%) of the best one. A rank with 3%
    step-time noise (1.7% at 5 steps) waits for ``min_steps``, a steady one (~1%) does not."""
    early = max(3, -(-config.min_steps // 2))
    return fit is not None and fit.n >= early and _rel_error(fit) <= _EARLY_SE * config.min_gain


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
    reasons = sorted(set(last.throttle_reasons) & THROTTLE_REASONS)
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


def _cost_trend(steps: Sequence[Any], a: float,
                min_steps: int) -> tuple[float, float, bool, bool] | None:
    """Per-sample cost trend: (slope per step, level at the last step, significant, linear)."""
    if len(steps) < max(2 * min_steps, 6):
        return None
    xa = np.array([float(s.batch_index) for s in steps])
    ya = np.array([max(s.compute_ms - a, 0.0) / s.local_batch_size for s in steps])
    got = robust_trend(xa, ya)
    if got is None:
        return None
    slope, icpt = got
    resid = ya - (icpt + slope * xa)
    sigma = _MAD * float(np.median(np.abs(resid - np.median(resid))))
    # Noise from successive differences ignores any trend or single jump.
    noise = _MAD * float(np.median(np.abs(np.diff(ya)))) / math.sqrt(2.0)
    spread = float(np.sqrt(((xa - xa.mean()) ** 2).sum())) or 1.0
    significant = abs(slope) > 3.0 * 1.25 * sigma / spread
    linear = sigma <= 2.0 * noise + 1e-12
    return slope, icpt + slope * float(xa[-1]), significant, linear


def predictive_strategy(obs: JobObservation, config: PolicyConfig,
                        constraints: Constraints) -> Estimate | NoProposal:
    """Profiled fit, pushed ``horizon_steps`` ahead by each rank's trend and device signals.

    Per rank, the forecast per-sample cost is the larger of: the robust trend of measured
    cost extrapolated over the horizon (when the trend is significant), and the cost scaled
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
        # the whole window tells them apart: a line fits a ramp down to the noise level.
        trend = _cost_trend(window, a, config.min_steps)
        if trend is None or not trend[3]:
            trend = _cost_trend(window[-n:], a, config.min_steps)
        if trend is not None and trend[2]:
            slope, level, _, _ = trend
            c_now = max(level, 1e-12)
            c_trend = max(c_now + slope * h, 0.5 * c_now)
            info["trend_per_step"] = slope
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
    return Estimate(base.a_ms, tuple(c_new), base.units, base.fit_r2, base.n_steps,
                    base.rel_error, evidence, base.hold)


register_strategy("static", static_strategy)
register_strategy("profiled", profiled_strategy)
register_strategy("predictive", predictive_strategy)

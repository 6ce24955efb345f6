"""Seeded simulator of a data-parallel job, to run any strategy in the loop.

Each rank has true costs ``t_i(b) = a_i + c_i * b`` that may jump (sudden slowdown) or
drift (thermal throttling, with matching device signals: temperature rises first, then
the SM clock falls with a ``sw_thermal`` clock-event reason). Measured compute times carry
multiplicative log-normal noise. The loop calls ``decide`` every step, as auto mode would,
and applies a proposal ``apply_lag`` steps later. The oracle is the split ``solve`` gives
with the true costs of each step, timed with the same noise draws.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .engine import decide
from .solver import NO_CONSTRAINTS, solve
from .types import (
    Constraints,
    DeviceSignals,
    JobObservation,
    PolicyConfig,
    Proposal,
    RankObservation,
    StepSample,
)

__all__ = ["SimRank", "SimResult", "JobSimulator", "SCENARIOS"]

SCENARIOS = ("static_mix", "sudden_slowdown", "thermal_drift", "noisy_rank")
_CLOCK_MAX_MHZ = 1980.0
_TEMP_IDLE_C = 62.0
_TEMP_HOT_C = 86.0


@dataclass(frozen=True, slots=True)
class SimRank:
    """True behaviour of one simulated rank."""

    a_ms: float
    c_ms: float
    device_type: str | None = None
    noise: float = 0.03  # relative sigma of the multiplicative noise
    slow_at: int | None = None  # step at which c jumps by slow_factor
    slow_factor: float = 1.0
    drift_start: int | None = None  # step at which the clock starts to fall
    drift_steps: int = 100  # steps for c to reach drift_factor
    drift_factor: float = 1.0
    heat_lead_steps: int = 20  # temperature climbs this long before the clock falls

    def drift(self, step: int) -> float:
        if self.drift_start is None:
            return 1.0
        frac = min(max((step - self.drift_start) / max(self.drift_steps, 1), 0.0), 1.0)
        return 1.0 + (self.drift_factor - 1.0) * frac

    def cost(self, step: int) -> tuple[float, float]:
        c = self.c_ms * self.drift(step)
        if self.slow_at is not None and step >= self.slow_at:
            c *= self.slow_factor
        return self.a_ms, c

    def signals(self, step: int, t: float) -> DeviceSignals:
        d = self.drift(step)
        temp = _TEMP_IDLE_C
        if self.drift_start is not None:
            start = self.drift_start - self.heat_lead_steps
            frac = min(max((step - start) / max(self.heat_lead_steps, 1), 0.0), 1.0)
            temp = _TEMP_IDLE_C + (_TEMP_HOT_C - _TEMP_IDLE_C) * frac
        reasons = ("sw_thermal",) if d > 1.005 else ()
        return DeviceSignals(t=t, temp_c=temp, sm_clock_mhz=_CLOCK_MAX_MHZ / d,
                             sm_clock_max_mhz=_CLOCK_MAX_MHZ, throttle_reasons=reasons)


@dataclass(slots=True)
class SimResult:
    """What one run recorded; ``ratio()`` is mean step time over the oracle's."""

    strategy: str
    step_ms: list[float] = field(default_factory=list)
    oracle_ms: list[float] = field(default_factory=list)
    shares: list[tuple[int, ...]] = field(default_factory=list)  # in force at each step
    proposals: list[tuple[int, tuple[int, ...], str]] = field(default_factory=list)
    applied_at: list[int] = field(default_factory=list)

    def ratio(self, start: int = 0, stop: int | None = None) -> float:
        s = self.step_ms[start:stop]
        o = self.oracle_ms[start:stop]
        return float(np.mean(s) / np.mean(o)) if s else float("nan")


class JobSimulator:
    """A seeded job: ``JobSimulator.scenario("thermal_drift").run("predictive", 300)``."""

    def __init__(self, ranks: Sequence[SimRank], global_batch_size: int, *, seed: int = 0,
                 constraints: Constraints = NO_CONSTRAINTS, apply_lag: int = 2,
                 sync_ms: float = 1.0, window_steps: int = 200, name: str = "custom"):
        if not ranks:
            raise ValueError("a simulated job needs at least one rank.")
        if apply_lag < 0:
            raise ValueError(f"apply_lag must be >= 0, got {apply_lag}.")
        self.ranks = tuple(ranks)
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.constraints = constraints
        self.apply_lag = apply_lag
        self.sync_ms = sync_ms
        self.window_steps = window_steps
        self.name = name
        n = len(self.ranks)
        # Version 0: the uniform split, honouring drains and pins.
        self.initial_shares = solve([0.0] * n, [1.0] * n, global_batch_size, constraints)

    @classmethod
    def scenario(cls, name: str, *, seed: int = 0, global_batch_size: int = 256,
                 **kwargs: object) -> JobSimulator:
        """One of :data:`SCENARIOS`, 8 ranks, ``global_batch_size`` 256 by default."""
        if name == "static_mix":
            # Fixed costs of a few ms beside per-sample work of ~1-7 ms per sample.
            kinds = [("H100", 2.0, 1.0), ("A100-80GB", 2.5, 2.6), ("L40S", 2.5, 3.1),
                     ("A10G", 3.0, 7.0)]
            ranks = [SimRank(a, c, dev) for dev, a, c in kinds for _ in range(2)]
        elif name == "sudden_slowdown":
            ranks = [SimRank(4.0, 0.8, "A100-80GB",
                             slow_at=60 if i == 5 else None, slow_factor=2.0)
                     for i in range(8)]
        elif name == "thermal_drift":
            ranks = [SimRank(3.0, 0.5, "H100", drift_start=60 if i == 2 else None,
                             drift_steps=120, drift_factor=1.8)
                     for i in range(8)]
        elif name == "noisy_rank":
            # Rank 3 is noisy but as fast as the others; rank 6 is really 1.5x slower;
            # rank 7 is drained (maintenance).
            ranks = [SimRank(4.0, 1.2 if i == 6 else 0.8, "A100-80GB",
                             noise=0.25 if i == 3 else 0.03)
                     for i in range(8)]
            kwargs.setdefault("constraints", Constraints(drains=frozenset({7})))
        else:
            raise ValueError(f"unknown scenario {name!r}; expected one of {', '.join(SCENARIOS)}.")
        return cls(ranks, global_batch_size, seed=seed, name=name, **kwargs)  # type: ignore[arg-type]

    def oracle_shares(self, step: int) -> tuple[int, ...]:
        a, c = zip(*(r.cost(step) for r in self.ranks), strict=True)
        return solve(a, c, self.global_batch_size, self.constraints)

    def run(self, strategy: str | None, steps: int,
            config: PolicyConfig | None = None) -> SimResult:
        """Run ``steps`` steps; ``strategy`` None keeps version 0 (the uniform baseline)."""
        n = len(self.ranks)
        if config is None:
            config = PolicyConfig(strategy=strategy or "profiled")
        elif strategy is not None:
            config = replace(config, strategy=strategy)
        rng = np.random.default_rng(self.seed)
        sigma = np.array([r.noise for r in self.ranks])
        # Same draws for every strategy and the oracle: differences come from the split.
        noise = np.exp(rng.normal(0.0, 1.0, (steps, n)) * sigma - 0.5 * sigma**2)
        result = SimResult(strategy or "uniform")
        shares = self.initial_shares
        version, changed_at = 0, 0
        pending: tuple[int, tuple[int, ...]] | None = None
        hist = [deque[StepSample](maxlen=self.window_steps) for _ in range(n)]
        dev = [deque[DeviceSignals](maxlen=120) for _ in range(n)]
        clock_s = 0.0
        oracle_cache: tuple[tuple, tuple[int, ...]] | None = None
        for k in range(steps):
            if pending is not None and pending[0] == k:
                shares, version, changed_at, pending = pending[1], version + 1, k, None
                result.applied_at.append(k)
            costs = tuple(r.cost(k) for r in self.ranks)
            if oracle_cache is None or oracle_cache[0] != costs:
                oracle_cache = (costs, self.oracle_shares(k))
            best = oracle_cache[1]
            times = [(a + c * b) * noise[k, i] for i, ((a, c), b) in
                     enumerate(zip(costs, shares, strict=True))]
            step_ms = max(t for t, b in zip(times, shares, strict=True) if b > 0) + self.sync_ms
            oracle = max((a + c * b) * noise[k, i] for i, ((a, c), b) in
                         enumerate(zip(costs, best, strict=True)) if b > 0) + self.sync_ms
            result.step_ms.append(step_ms)
            result.oracle_ms.append(oracle)
            result.shares.append(shares)
            clock_s += step_ms / 1000.0
            for i, r in enumerate(self.ranks):
                hist[i].append(StepSample(k, shares[i], times[i]))
                dev[i].append(r.signals(k, clock_s))
            if strategy is None or pending is not None:
                continue
            obs = JobObservation(
                job=self.name, world_size=n, global_batch_size=self.global_batch_size,
                batch_index=k, shares=shares, placement_version=version,
                steps_since_change=k + 1 - changed_at,
                ranks=tuple(RankObservation(rank=i, device_type=r.device_type,
                                            steps=tuple(hist[i]), device=tuple(dev[i]))
                            for i, r in enumerate(self.ranks)),
            )
            d = decide(obs, config, self.constraints)
            if isinstance(d, Proposal):
                result.proposals.append((k, d.shares, d.reason))
                pending = (k + 1 + self.apply_lag, d.shares)
        return result

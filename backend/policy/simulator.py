"""Seeded simulator of a data-parallel job, to run any strategy in the loop.

Each rank has true costs ``t_i(b) = a_i + c_i * b`` that may jump (sudden slowdown) or
drift (thermal throttling, with matching device signals: temperature rises first, then
the SM clock falls with a ``sw_thermal`` clock-event reason). Measured compute times carry
multiplicative log-normal noise. The loop calls ``decide`` every step, as auto mode would,
and applies a proposal ``apply_lag`` steps later. The oracle is the split ``solve`` gives
with the true costs of each step, timed with the same noise draws.

A rank may also have a memory model (peak ``m0 + m * b`` bytes on a card of ``total``): it
then sends a peak-memory reading every ``memory_every`` steps, as the hook does, the policy
fits and caps it, and the oracle is the capped oracle (the best split under the true
memory caps). ``SimResult.oom_steps`` counts steps whose true peak went past a card.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .engine import decide, with_caps
from .memory import DEFAULT_HEADROOM, MemoryFit, MemoryReading, RankMemory, fit_memory, memory_cap
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

SCENARIOS = ("static_mix", "sudden_slowdown", "thermal_drift", "noisy_rank", "memory_caps")
_GIB = 2**30
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
    # Peak device memory m0 + m * b on a card of mem_total_bytes (None: not measured, CPU).
    mem_fixed_bytes: float | None = None
    mem_per_sample_bytes: float | None = None
    mem_total_bytes: int | None = None

    def memory_fit(self) -> MemoryFit | None:
        """The true memory model as a fit (None without one)."""
        if self.mem_per_sample_bytes is None or self.mem_total_bytes is None:
            return None
        return MemoryFit(self.mem_fixed_bytes or 0.0, self.mem_per_sample_bytes,
                         self.mem_total_bytes, 0, 2, "linear", 0, 0)

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
    oom_steps: int = 0  # steps where some rank's true peak memory went past its card

    def ratio(self, start: int = 0, stop: int | None = None) -> float:
        s = self.step_ms[start:stop]
        o = self.oracle_ms[start:stop]
        return float(np.mean(s) / np.mean(o)) if s else float("nan")


class JobSimulator:
    """A seeded job: ``JobSimulator.scenario("thermal_drift").run("predictive", 300)``."""

    def __init__(self, ranks: Sequence[SimRank], global_batch_size: int, *, seed: int = 0,
                 constraints: Constraints = NO_CONSTRAINTS, apply_lag: int = 2,
                 sync_ms: float = 1.0, window_steps: int = 200, name: str = "custom",
                 memory_headroom: float = DEFAULT_HEADROOM, memory_every: int = 8,
                 measure_memory: bool = True):
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
        self.memory_every = memory_every
        self.measure_memory = measure_memory  # False: the policy sees no memory (old hooks)
        n = len(self.ranks)
        # The true memory caps: the capped oracle never goes past them.
        self.true_memory_caps = {
            i: cap for i, r in enumerate(self.ranks)
            if (fit := r.memory_fit()) is not None
            and (cap := memory_cap(fit, r.mem_total_bytes, memory_headroom)) is not None}
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
        elif name == "memory_caps":
            # Ranks 0-1 are 3x faster per sample but have 32 GiB cards: speed alone gives
            # them 64 samples each, their memory (4 GiB + 0.5 GiB a sample) holds 49.
            ranks = [SimRank(3.0, 1.0 if i < 2 else 3.0, "A100-80GB", mem_fixed_bytes=4.0 * _GIB,
                             mem_per_sample_bytes=0.5 * _GIB,
                             mem_total_bytes=(32 if i < 2 else 80) * _GIB)
                     for i in range(8)]
        else:
            raise ValueError(f"unknown scenario {name!r}; expected one of {', '.join(SCENARIOS)}.")
        return cls(ranks, global_batch_size, seed=seed, name=name, **kwargs)  # type: ignore[arg-type]

    def oracle_shares(self, step: int) -> tuple[int, ...]:
        a, c = zip(*(r.cost(step) for r in self.ranks), strict=True)
        return solve(a, c, self.global_batch_size, with_caps(self.constraints, self.true_memory_caps))

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
        readings = [deque[MemoryReading](maxlen=256) for _ in range(n)]
        memory = [RankMemory("sim" if r.memory_fit() and self.measure_memory else "", None,
                             r.mem_total_bytes) for r in self.ranks]
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
            result.oom_steps += self._memory_step(k, shares, readings, memory)
            if strategy is None or pending is not None:
                continue
            obs = JobObservation(
                job=self.name, world_size=n, global_batch_size=self.global_batch_size,
                batch_index=k, shares=shares, placement_version=version,
                steps_since_change=k + 1 - changed_at,
                ranks=tuple(RankObservation(rank=i, device_type=r.device_type,
                                            steps=tuple(hist[i]), device=tuple(dev[i]),
                                            memory=memory[i])
                            for i, r in enumerate(self.ranks)),
            )
            d = decide(obs, config, self.constraints)
            if isinstance(d, Proposal):
                result.proposals.append((k, d.shares, d.reason))
                pending = (k + 1 + self.apply_lag, d.shares)
        return result

    def _memory_step(self, k: int, shares: Sequence[int], readings: list[deque[MemoryReading]],
                     memory: list[RankMemory]) -> int:
        """Every ``memory_every`` steps each measured rank sends its peak (the first window
        is the hook's warm-up and sends none); returns 1 if a card ran out of memory."""
        over = 0
        for i, r in enumerate(self.ranks):
            fit = r.memory_fit()
            if fit is None:
                continue
            peak = fit.predict(shares[i])
            over |= int(r.mem_total_bytes is not None and peak > r.mem_total_bytes)
            if not self.measure_memory:
                continue
            if (k + 1) % self.memory_every == 0 and k + 1 > self.memory_every and shares[i] > 0:
                readings[i].append(MemoryReading(shares[i], int(peak), r.mem_total_bytes))
                memory[i] = RankMemory("sim", fit_memory(readings[i]), r.mem_total_bytes)
        return over

"""Closed-loop simulator of the hook's cadence and the controller's policy runs.

Where do the steps between a rank's slowdown and the placement that answers it go? This
models, step by step and in simulated wall-clock time, what a real job does:

- every rank's compute time is ``(a + c*b) * factor(step)`` with seeded log-normal noise
  (and optional outlier steps); a step lasts as long as the slowest working rank plus a
  fixed overhead;
- each rank's transport sends a metrics frame when ``flush_steps`` steps wait or
  ``flush_interval_s`` passed, and at once when a step deviates from its recent median by
  ``deviation_flush`` (a lever);
- the controller runs the real policy (``backend.policy.decide``) on a frame, at most
  every ``min_interval_s`` unless the frame carries a deviation (a lever), only once every
  rank trains under the placement in force, applies proposals (auto mode), judges their
  measured effect with the real ``judge_effect`` (with ``speed_factor``), rolls back what got worse;
- rank 0 runs the real exchange schedule (``trainer_hook.channel.ControlChannel`` without
  a process group): a placement takes effect ``lag + lookahead`` to ``every + lag +
  lookahead`` steps after it reaches rank 0.

Nothing here sleeps: a 500-step case runs in well under a second of policy time, and the
same seed gives the same run (the no-churn and outlier tests use it).

    python -m bench.reaction --sim            # every case, today's cadence and the levers
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from backend.control.effect import SETTLE_STEPS, before_window, judge_effect, speed_factor
from backend.policy import (
    JobObservation,
    PolicyConfig,
    Proposal,
    RankObservation,
    Rollback,
    StepSample,
    decide,
    predicted_step_ms,
    solve,
)
from trainer_hook.channel import ControlChannel, PendingPlacement
from trainer_hook.placement import PlacementSchedule

__all__ = ["Cadence", "SimCase", "SimRun", "TODAY", "LEVERS", "DEFAULTS", "CASES", "simulate",
           "steps_to_within"]


@dataclass(frozen=True, slots=True)
class Cadence:
    """Hook and controller timing (today's defaults)."""

    name: str = "today"
    exchange_every: int = 4
    exchange_lag: int = 2
    lookahead: int = 8
    flush_steps: int = 5
    flush_interval_s: float = 0.5
    deviation_flush: float | None = None  # flush at once on a step this far off its median
    eager_steps: int = 0  # flush every step of the first ones (the policy's warm-up)
    min_interval_s: float = 0.5  # controller: seconds between policy runs
    deviation_runs: bool = False  # a frame with a deviation runs the policy at once
    net_ms: float = 1.0  # one way, hook <-> backend
    think_ms: float = 3.0  # one policy run
    effect_window_steps: int = 20
    rollback_threshold: float = 0.05


TODAY = Cadence()
LEVERS = Cadence(name="levers", exchange_every=2, exchange_lag=1, lookahead=1,
                 deviation_flush=0.2, deviation_runs=True, eager_steps=16)
# The defaults after issue 13 (and issue 10's measured lookahead, 1 for a loader without
# workers): every lever but the exchange cadence, which stays every 4 steps.
DEFAULTS = Cadence(name="defaults", lookahead=1, deviation_flush=0.2, deviation_runs=True,
                   eager_steps=20)


@dataclass(frozen=True, slots=True)
class SimCase:
    """A job: per-rank speeds, a cost change, noise."""

    name: str
    speeds: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)
    steps: int = 200
    global_batch_size: int = 64
    per_sample_ms: float = 2.0
    fixed_ms: float = 2.0
    overhead_ms: float = 3.0  # sync and framework: the split does not change it
    noise: float = 0.03
    slowdown: tuple[int, int, float] | None = None  # rank, step, factor
    drift: tuple[int, int, float] | None = None  # rank, start step, percent per step
    outliers: tuple[tuple[int, int, float], ...] = ()  # rank, step, factor
    event: int = 0  # the step measured from

    def factor(self, rank: int, step: int) -> float:
        f = 1.0
        if self.slowdown and rank == self.slowdown[0] and step >= self.slowdown[1]:
            f *= self.slowdown[2]
        if self.drift and rank == self.drift[0] and step >= self.drift[1]:
            f *= max(0.0, 1.0 + self.drift[2] / 100.0 * (step - self.drift[1]))
        return f

    def costs(self, step: int) -> tuple[list[float], list[float]]:
        a = [self.fixed_ms * self.factor(i, step) for i in range(len(self.speeds))]
        c = [self.per_sample_ms / s * self.factor(i, step) for i, s in enumerate(self.speeds)]
        return a, c


@dataclass(slots=True)
class SimRun:
    case: SimCase
    cadence: Cadence
    strategy: str
    shares: list[tuple[int, ...]] = field(default_factory=list)  # in force at each step
    step_ms: list[float] = field(default_factory=list)
    proposals: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (step, shares)
    rollbacks: list[int] = field(default_factory=list)  # steps at which a rollback was decided
    policy_runs: int = 0
    decisions: list[tuple[int, str]] = field(default_factory=list)  # (latest step, outcome)

    def model_ratio(self, k: int) -> float:
        """True model step time of the split in force at step ``k`` over the oracle's."""
        a, c = self.case.costs(k)
        best = solve(a, c, self.case.global_batch_size)
        return predicted_step_ms(a, c, self.shares[k]) / predicted_step_ms(a, c, best)


def steps_to_within(run: SimRun, tol: float, start: int | None = None) -> int | None:
    """Steps after ``start`` (the case's event) until the split in force stays within
    ``tol`` of the moving oracle to the end of the run; None if it never does."""
    start = run.case.event if start is None else start
    last_bad = None
    for k in range(start, len(run.shares)):
        if run.model_ratio(k) > 1.0 + tol:
            last_bad = k
    if last_bad is None:
        return 0
    return None if last_bad >= len(run.shares) - 1 else last_bad + 1 - start


class _Steps:
    """The controller's live buffers as ``effect.speed_factor`` reads them: each rank's steps."""

    def __init__(self, got: list[list[StepSample]]) -> None:
        self.got = got

    def steps(self, job: str, *, batch_from: int, batch_to: int) -> Any:
        for rank, rows in enumerate(self.got):
            for s in rows:
                if batch_from <= s.batch_index <= batch_to:
                    yield rank, s

    def work_by_batch(self, job: str, rank: int) -> dict[int, tuple[float, float, float | None, float | None]]:
        """The simulated samples carry no cost (every sample costs 1): no work rows."""
        return {}


class _Rank:
    """One rank's transport: steps waiting to be sent, its recent per-sample costs."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, int, float, int]] = []  # (k, b, compute_ms, version)
        self.last_flush_t = 0.0
        self.recent: deque[float] = deque(maxlen=8)


@dataclass(slots=True)
class _Ctl:
    """What the controller keeps for the job."""

    shares: tuple[int, ...]
    version: int = 0
    previous: tuple[int, ...] | None = None
    effective: int = 0
    applied: bool = True
    measured: bool = True
    before_ms: float | None = None
    auto: bool = False
    last_run: float = -1e9
    busy_until: float = -1e9
    latest: int = -1


@dataclass(order=True)
class _Event:
    t: float
    seq: int
    kind: str = field(compare=False)
    data: Any = field(compare=False)


def simulate(case: SimCase, cadence: Cadence = TODAY, strategy: str | None = "profiled",
             seed: int = 0, config: PolicyConfig | None = None) -> SimRun:
    """Run ``case`` under ``cadence`` in auto mode from no knowledge (uniform split);
    ``strategy`` None never runs the policy (the uniform baseline)."""
    n, big_b = len(case.speeds), case.global_batch_size
    cfg = config or PolicyConfig(strategy=strategy or "profiled", max_move_fraction=0.25)
    rng = np.random.default_rng(seed)
    sigma = case.noise
    noise = np.exp(rng.normal(0.0, 1.0, (case.steps, n)) * sigma - 0.5 * sigma**2)
    for o_rank, o_step, o_factor in case.outliers:
        if 0 <= o_step < case.steps:
            noise[o_step, o_rank] *= o_factor
    schedule = PlacementSchedule(n, big_b, settled_until=-1)
    channel = ControlChannel(rank=0, world_size=n, schedule=schedule,
                             exchange_every=cadence.exchange_every,
                             exchange_lag=cadence.exchange_lag, lookahead=cadence.lookahead)
    run = SimRun(case, cadence, strategy or "uniform")
    ranks = [_Rank() for _ in range(n)]
    events: list[_Event] = []
    seq = 0

    def push(t: float, kind: str, data: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, _Event(t, seq, kind, data))

    # Controller state (what backend.controller keeps per job).
    got: list[list[StepSample]] = [[] for _ in range(n)]
    got_version: list[int] = [0] * n
    first_k: dict[int, int] = {0: 0}  # first batch index seen under each version
    step_by_k: dict[int, list[float]] = {}
    ctl = _Ctl(shares=tuple(schedule.at(0).shares))
    rollbacks: list[Rollback] = []
    offered_version = [0]

    def window_ms(lo: int, hi: int) -> float | None:
        vals = [statistics.median(step_by_k[k]) for k in range(max(0, lo), hi + 1)
                if k in step_by_k and len(step_by_k[k]) == n]
        return sum(vals) / len(vals) if vals else None

    def issue(now: float, shares: tuple[int, ...], *, auto: bool, rollback: bool) -> None:
        ctl.previous = None if rollback else ctl.shares
        ctl.version += 1
        ctl.shares, ctl.applied, ctl.measured, ctl.auto = shares, False, False, auto
        push(now + cadence.net_ms, "to_rank0", (ctl.version, shares))

    def on_frame(now: float, rank: int, rows: list[tuple[int, int, float, int]],
                 deviation: bool) -> None:
        for k, b, compute, version in rows:
            got[rank].append(StepSample(k, b, compute))
            got_version[rank] = max(got_version[rank], version)
            first_k[version] = min(first_k.get(version, k), k)
            ctl.latest = max(ctl.latest, k)
        # Acks: every rank trains under the version in force -> applied at its first batch.
        if not ctl.applied and all(v >= ctl.version for v in got_version):
            ctl.applied = True
            ctl.effective = eff = first_k[ctl.version]
            ctl.before_ms = window_ms(eff - cadence.effect_window_steps, eff - 1)
        if ctl.applied and not ctl.measured:
            lo = ctl.effective + SETTLE_STEPS
            hi = lo + cadence.effect_window_steps - 1
            if ctl.latest >= hi:
                after = window_ms(lo, hi)
                if after is not None:
                    ctl.measured = True
                    # As the controller judges it: against what the old split would have
                    # taken at the speeds measured since (a drift slows it down meanwhile).
                    factor = 1.0 if ctl.previous is None else speed_factor(
                        _Steps(got), case.name, shares=ctl.previous,
                        before=before_window(ctl.effective, cadence.effect_window_steps),
                        after=(lo, hi))
                    verdict = judge_effect(
                        version=ctl.version, step_ms_before=ctl.before_ms,
                        step_ms_after=after, rollback_threshold=cadence.rollback_threshold,
                        may_roll_back=ctl.auto and ctl.previous is not None, speed_factor=factor)
                    if verdict.rollback_reason is not None:
                        prev = ctl.previous
                        assert prev is not None
                        rollbacks.append(Rollback(ctl.latest, tuple(prev), tuple(ctl.shares)))
                        run.rollbacks.append(ctl.latest)
                        issue(now, tuple(prev), auto=False, rollback=True)
                        return
        if strategy is None or not ctl.applied or now < ctl.busy_until:
            return
        warming = run.proposals == []
        if not (warming or (deviation and cadence.deviation_runs)) and \
                now - ctl.last_run < cadence.min_interval_s * 1000.0:
            return
        ctl.last_run = now
        ctl.busy_until = now + cadence.think_ms
        run.policy_runs += 1
        obs = JobObservation(
            job=case.name, world_size=n, global_batch_size=big_b, batch_index=ctl.latest,
            shares=tuple(ctl.shares), placement_version=ctl.version,
            steps_since_change=max(0, ctl.latest - ctl.effective),
            ranks=tuple(RankObservation(rank=i, steps=tuple(
                [s for s in got[i] if s.local_batch_size > 0][-cfg.window_steps:]))
                for i in range(n)),
            rollbacks=tuple(rollbacks[-4:]),
        )
        d = decide(obs, cfg)
        run.decisions.append((ctl.latest, "proposal" if isinstance(d, Proposal) else d.detail))
        if isinstance(d, Proposal) and tuple(d.shares) != tuple(ctl.shares):
            run.proposals.append((ctl.latest, tuple(d.shares)))
            issue(now + cadence.think_ms, tuple(d.shares), auto=True, rollback=False)

    t = 0.0
    for k in range(case.steps):
        # Everything due before this step starts: frames, placements reaching rank 0.
        while events and events[0].t <= t:
            ev = heapq.heappop(events)
            if ev.kind == "frame":
                on_frame(ev.t, *ev.data)
            elif ev.kind == "to_rank0":
                version, shares = ev.data
                if version > offered_version[0]:
                    offered_version[0] = version
                    channel.offer(PendingPlacement(version, shares))
        channel.on_step(k)
        p = schedule.at(k)
        shares = p.shares
        run.shares.append(shares)
        a, c = case.costs(k)
        times = [(a[i] + c[i] * shares[i]) * noise[k, i] if shares[i] > 0 else 0.2
                 for i in range(n)]
        step = max(times) + case.overhead_ms
        run.step_ms.append(step)
        t += step
        step_by_k[k] = []
        for i, r in enumerate(ranks):
            step_by_k[k].append(step)
            r.pending.append((k, shares[i], times[i], p.version))
            deviation = False
            if shares[i] > 0:
                per = times[i] / shares[i]
                if cadence.deviation_flush is not None and len(r.recent) >= 3:
                    med = statistics.median(r.recent)
                    deviation = abs(per / med - 1.0) >= cadence.deviation_flush
                r.recent.append(per)
            if deviation or k < cadence.eager_steps or len(r.pending) >= cadence.flush_steps or \
                    t - r.last_flush_t >= cadence.flush_interval_s * 1000.0:
                push(t + cadence.net_ms, "frame", (i, r.pending, deviation))
                r.pending, r.last_flush_t = [], t
    return run


def _slowdowns() -> list[SimCase]:
    out = []
    for factor in (1.5, 2.0, 4.0):
        for rank in (3, 0):
            for b in (64, 128):
                out.append(SimCase(f"slowdown {factor:g}x rank {rank} B={b}", global_batch_size=b,
                                   steps=160, slowdown=(rank, 80, factor), event=80))
    return out


CASES: dict[str, Callable[[], list[SimCase]]] = {
    "slowdown": _slowdowns,
    "no_knowledge": lambda: [SimCase("no knowledge 1,1,0.5,0.25", speeds=(1, 1, 0.5, 0.25),
                                     steps=80)],
    # The second drift case has a real CPU job's timing noise (~1%): its trend is
    # significant sooner, on a younger segment, than at the default 3%.
    "drift": lambda: [SimCase("drift 1%/step rank 3", steps=200, drift=(3, 60, 1.0), event=60),
                      SimCase("drift 1%/step rank 3, 1% noise", steps=200, drift=(3, 60, 1.0),
                              event=60, noise=0.01)],
    "equal": lambda: [SimCase("equal ranks, 5% noise", steps=500, noise=0.05)],
    "outliers": lambda: [SimCase("one 10x outlier step", steps=300, outliers=((2, 150, 10.0),),
                                 event=100)],
    "drained": lambda: [SimCase("drained rank 1,1,0.01", speeds=(1, 1, 0.01), steps=800,
                                per_sample_ms=0.05, fixed_ms=0.5, overhead_ms=1.0)],
}


def run_cases(cadences: Sequence[Cadence] = (TODAY, DEFAULTS, LEVERS),
              strategies: Sequence[str] = ("profiled", "predictive"),
              kinds: Sequence[str] = tuple(CASES)) -> list[dict[str, Any]]:
    rows = []
    for kind in kinds:
        for case in CASES[kind]():
            for cad in cadences:
                for strategy in strategies:
                    run = simulate(case, cad, strategy)
                    rows.append({
                        "kind": kind, "case": case.name, "cadence": cad.name, "strategy": strategy,
                        "steps_to_10pct": steps_to_within(run, 0.10),
                        "steps_to_5pct": steps_to_within(run, 0.05),
                        "proposals": len(run.proposals), "rollbacks": len(run.rollbacks),
                        "policy_runs": run.policy_runs,
                    })
    return rows


def summary(rows: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """Per cadence and strategy: the issue-13 figures."""
    out = []
    order = {"today": 0, "defaults": 1, "levers": 2}
    keys = sorted({(r["cadence"], r["strategy"]) for r in rows}, key=lambda k: (order.get(k[0], 3), k))
    for cad, strategy in keys:
        mine = [r for r in rows if r["cadence"] == cad and r["strategy"] == strategy]

        def of(kind: str, key: str, mine: list[dict[str, Any]] = mine) -> list[Any]:
            return [r[key] for r in mine if r["kind"] == kind]

        slow = [x if x is not None else 10_000 for x in of("slowdown", "steps_to_10pct")]
        out.append([cad, strategy, statistics.median(slow) if slow else None, max(slow, default=None),
                    of("no_knowledge", "steps_to_5pct")[0], of("drift", "steps_to_10pct")[0],
                    of("equal", "proposals")[0], of("outliers", "proposals")[0],
                    of("drained", "rollbacks")[0], of("drift", "steps_to_10pct")[1]])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m bench.reaction --sim")
    ap.add_argument("--out", type=Path, default=None, help="write rows and summary as JSON here")
    args = ap.parse_args(list(argv or []))
    rows = run_cases()
    head = f"{'case':38} {'cadence':8} {'strategy':10} {'to10%':>6} {'to5%':>6} {'props':>5} {'rb':>3}"
    print(head)
    for r in rows:
        print(f"{r['case']:38} {r['cadence']:8} {r['strategy']:10} {str(r['steps_to_10pct']):>6} "
              f"{str(r['steps_to_5pct']):>6} {r['proposals']:>5} {r['rollbacks']:>3}")
    table = summary(rows)
    print("\ncadence  strategy    slowdown to 10% (median, max)  no knowledge to 5%  drift to 10%  "
          "equal: proposals  outlier: proposals  drained: rollbacks  drift, 1% noise")
    for c in table:
        print(f"{c[0]:8} {c[1]:10} {str(c[2]):>14} {str(c[3]):>6} {str(c[4]):>19} {str(c[5]):>13} "
              f"{c[6]:>17} {c[7]:>19} {c[8]:>19} {str(c[9]):>16}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "summary": table,
                                        "cadences": [asdict(TODAY), asdict(LEVERS)]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


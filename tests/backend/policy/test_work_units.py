"""The policy balances work, not samples, when steps carry a per-sample cost (issue 23)."""

from __future__ import annotations

import pickle
import random

import pytest

from backend.control.inputs import observation_rows
from backend.live.state import LiveState
from backend.policy import decide
from backend.policy.types import (
    JobObservation,
    PolicyConfig,
    Proposal,
    RankObservation,
    StepSample,
)
from backend.policy.work import in_work_units, mean_batch_work
from rebalancer_wire.protocol import Hello, Metrics, ProtocolError, StepRecord
from trainer_hook.sampler import lpt_partition

B = 96


def _lengths(rng: random.Random, n: int) -> list[float]:
    # Short chat turns and long documents: a heavy tail to several thousand tokens.
    return [rng.randint(20, 200) if rng.random() < 0.8 else int(rng.paretovariate(1.2) * 500) % 6000 + 200
            for _ in range(n)]


def _simulate(speeds: list[float], steps: int, *, cost_aware: bool = True, seed: int = 0,
              config: PolicyConfig | None = None) -> tuple[list[float], int, tuple[int, ...]]:
    """A job whose rank i trains ``work / speeds[i]`` ms per step (1% noise), driven by
    ``decide`` and applying each proposal at once. Returns step times, proposals, shares."""
    rng = random.Random(seed)
    n = len(speeds)
    shares = tuple([B // n] * n)
    hist: list[list[StepSample]] = [[] for _ in range(n)]
    cfg = config or PolicyConfig(strategy="profiled", cooldown_steps=5, min_steps=5, window_steps=40)
    times, proposals, since = [], 0, 0
    for k in range(steps):
        costs = _lengths(rng, B)
        parts, work = lpt_partition(costs, shares)
        t = [work[i] / speeds[i] / 100 * (1 + rng.gauss(0, 0.01)) + 0.5 for i in range(n)]
        times.append(max(t))
        for i in range(n):
            if parts[i]:
                s = StepSample(k, len(parts[i]), t[i], work[i], float(sum(costs))) if cost_aware else \
                    StepSample(k, len(parts[i]), t[i])
                hist[i] = [*hist[i], s][-cfg.window_steps:]
        since += 1
        obs = JobObservation(job="j", world_size=n, global_batch_size=B, batch_index=k, shares=shares,
                             placement_version=proposals, steps_since_change=since,
                             ranks=tuple(RankObservation(rank=i, steps=tuple(hist[i])) for i in range(n)))
        d = decide(obs, cfg)
        if isinstance(d, Proposal):
            shares, since, proposals = d.shares, 0, proposals + 1
    return times, proposals, shares


def test_equal_ranks_under_variable_lengths_get_no_proposal() -> None:
    _, proposals, shares = _simulate([1.0, 1.0, 1.0, 1.0], 80)
    assert proposals == 0 and shares == (24, 24, 24, 24)


def test_unequal_ranks_reach_the_cost_aware_oracle_within_30_steps() -> None:
    speeds = [1.0, 0.8, 0.6, 0.4]
    times, proposals, shares = _simulate(speeds, 60)
    assert proposals >= 1
    # The oracle: the same batches partitioned by LPT on cost / true speed.
    rng = random.Random(0)
    oracle = []
    for _ in range(60):
        costs = _lengths(rng, B)
        _, work = lpt_partition(costs, [round(s * 1000) for s in speeds])
        oracle.append(max(w / s / 100 for w, s in zip(work, speeds, strict=True)) + 0.5)
    achieved = sum(times[30:]) / sum(oracle[30:])
    assert achieved <= 1.05, (achieved, shares)
    assert shares[0] > shares[1] > shares[2] > shares[3]


def test_steps_in_work_units_and_without_costs_unchanged() -> None:
    steps = (StepSample(0, 3, 10.0, 300.0, 1200.0), StepSample(1, 3, 12.0, 500.0, 800.0))
    obs = JobObservation(job="j", world_size=1, global_batch_size=12, batch_index=1, shares=(12,),
                         placement_version=0, steps_since_change=2,
                         ranks=(RankObservation(rank=0, steps=steps),))
    assert mean_batch_work(obs) == 1000.0
    got = in_work_units(obs).ranks[0].steps
    assert [s.local_batch_size for s in got] == [3.6, 6.0]
    plain = JobObservation(job="j", world_size=1, global_batch_size=12, batch_index=0, shares=(12,),
                           placement_version=0, steps_since_change=1,
                           ranks=(RankObservation(rank=0, steps=(StepSample(0, 12, 5.0),)),))
    assert in_work_units(plain) is plain


def test_step_records_carry_work_on_the_wire_and_into_the_observation() -> None:
    rec = StepRecord(batch_index=4, local_batch_size=3, placement_version=0, data_wait_ms=0.0,
                     compute_ms=5.0, sync_wait_ms=0.0, optimizer_ms=0.0, step_ms=6.0, t=1.0,
                     work=420.0, batch_work=1000.0)
    d = rec.to_dict()
    assert d["work"] == 420.0 and d["batch_work"] == 1000.0
    assert StepRecord.from_dict(d) == rec
    plain = StepRecord.from_dict({k: v for k, v in d.items() if k not in ("work", "batch_work")})
    assert plain.work is None and "work" not in plain.to_dict()
    with pytest.raises(ProtocolError, match="'work' must be a number between 0 and"):
        StepRecord.from_dict({**d, "work": -1.0})
    # Live state keeps the work beside the step rows; the observation carries it.
    live = LiveState()
    live.register(Hello(job="j", rank=0, world_size=1, global_batch_size=12))
    live.add_metrics(Metrics(job="j", rank=0, steps=[rec, StepRecord.from_dict({**d, "batch_index": 5})]))
    rows = observation_rows(live, "j", world_size=1, global_batch_size=12, shares=[12], version=0,
                            effective=0, window_steps=10)
    assert rows is not None
    obs = rows.build()
    assert obs.ranks[0].steps == (StepSample(4, 3, 5.0, 420.0, 1000.0), StepSample(5, 3, 5.0, 420.0, 1000.0))
    assert pickle.loads(pickle.dumps(rows)).build() == obs
    # The job view says how fast the rank works and what share of the work it has.
    view = live.view("j")
    assert view is not None
    assert view.ranks[0].work_per_s == pytest.approx(840.0 / 0.010)
    assert view.ranks[0].work_share == pytest.approx(0.42)


def test_a_token_job_reason_speaks_of_work_not_samples() -> None:
    rng = random.Random(5)
    n, speeds = 4, [1.0, 1.0, 1.0, 0.4]
    hist: list[list[StepSample]] = [[] for _ in range(n)]
    shares = (24, 24, 24, 24)
    for k in range(30):
        costs = _lengths(rng, B)
        parts, work = lpt_partition(costs, shares)
        for i in range(n):
            t = work[i] / speeds[i] / 100 * (1 + rng.gauss(0, 0.01)) + 0.5
            hist[i].append(StepSample(k, len(parts[i]), t, work[i], float(sum(costs))))
    obs = JobObservation(job="j", world_size=n, global_batch_size=B, batch_index=29, shares=shares,
                         placement_version=0, steps_since_change=30,
                         ranks=tuple(RankObservation(rank=i, steps=tuple(hist[i])) for i in range(n)))
    d = decide(obs, PolicyConfig(strategy="profiled", min_steps=5, window_steps=40))
    assert isinstance(d, Proposal), d
    assert "slower per unit of work than the median" in d.reason and "per sample" not in d.reason

"""Strategies in the loop of the seeded job simulator."""

from __future__ import annotations

import pytest

from backend.policy import JobSimulator, PolicyConfig, SimRank, predicted_step_ms

BUILTIN = ("static", "profiled", "predictive")


def _true_ratio(sim: JobSimulator, shares, step: int) -> float:
    a, c = zip(*(r.cost(step) for r in sim.ranks), strict=True)
    return predicted_step_ms(a, c, shares) / predicted_step_ms(a, c, sim.oracle_shares(step))


def test_profiled_reaches_the_oracle_within_3_percent_in_30_steps():
    sim = JobSimulator.scenario("static_mix", seed=1)
    res = sim.run("profiled", 60)
    assert _true_ratio(sim, res.shares[0], 0) > 2.0  # uniform start is far off
    assert _true_ratio(sim, res.shares[30], 30) <= 1.03
    assert res.ratio(30, 60) <= 1.03
    assert res.proposals[0][0] < 30


@pytest.mark.parametrize("strategy", BUILTIN)
def test_no_strategy_chases_noise(strategy):
    # Identical cards and pure measurement noise: nothing to gain, nothing proposed.
    ranks = [SimRank(3.0, 0.8, "A100-80GB", noise=0.08) for _ in range(6)]
    sim = JobSimulator(ranks, 192, seed=7)
    res = sim.run(strategy, 150)
    assert res.proposals == []
    assert all(s == res.shares[0] for s in res.shares)


@pytest.mark.parametrize("strategy", BUILTIN)
def test_at_most_one_proposal_per_cooldown_on_a_noisy_heterogeneous_job(strategy):
    cfg = PolicyConfig(cooldown_steps=20)
    sim = JobSimulator.scenario("static_mix", seed=3)
    res = sim.run(strategy, 150, cfg)
    steps = [k for k, _, _ in res.proposals]
    assert 1 <= len(steps) <= 2, res.proposals  # converges, then stops: no ping-pong
    assert all(b - a >= cfg.cooldown_steps for a, b in zip(steps, steps[1:], strict=False))


def test_predictive_moves_work_off_a_drifting_card_before_profiled():
    sim = JobSimulator.scenario("thermal_drift", seed=2)
    first = {}
    results = {}
    for strategy in ("profiled", "predictive"):
        res = sim.run(strategy, 160)
        results[strategy] = res
        first[strategy] = next(k for k, s in enumerate(res.shares) if s[2] < s[0])
    assert first["predictive"] < first["profiled"]
    assert results["predictive"].ratio(60) < results["profiled"].ratio(60)


def test_sudden_slowdown_is_followed():
    sim = JobSimulator.scenario("sudden_slowdown", seed=5)
    res = sim.run("profiled", 140)
    assert res.shares[59] == res.shares[0]
    assert res.shares[-1][5] < res.shares[-1][0]
    assert res.ratio(100) < 1.05 < JobSimulator.scenario("sudden_slowdown", seed=5).run(
        None, 140).ratio(100)


def test_drained_rank_never_gets_work_and_runs_are_seeded():
    sim = JobSimulator.scenario("noisy_rank", seed=9)
    one = sim.run("profiled", 60)
    two = sim.run("profiled", 60)
    assert one.step_ms == two.step_ms and one.shares == two.shares
    assert all(s[7] == 0 and sum(s) == 256 for s in one.shares)
    other = JobSimulator.scenario("noisy_rank", seed=10).run("profiled", 60)
    assert other.step_ms != one.step_ms


def test_unknown_scenario_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown scenario 'x'; expected one of static_mix"):
        JobSimulator.scenario("x")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_noisy_rank_is_not_handed_work_on_a_lucky_streak(seed):
    sim = JobSimulator.scenario("noisy_rank", seed=seed)
    oracle = sim.oracle_shares(0)
    res = sim.run("profiled", 120)
    assert res.proposals, "the really slow rank 6 must lose work"
    assert all(shares[3] <= oracle[3] + 1 for _, shares, _ in res.proposals)
    assert res.shares[-1][6] < res.shares[0][6]
    assert res.ratio(40) < 1.03


def test_memory_caps_scenario_stays_on_the_cards_and_near_the_capped_oracle():
    sim = JobSimulator.scenario("memory_caps", seed=4)
    assert sim.oracle_shares(0)[:2] == (49, 49)  # speed alone would give 64: memory holds 49
    res = sim.run("profiled", 120)
    assert res.oom_steps == 0
    assert all(s[0] <= 49 and s[1] <= 49 for s in res.shares)
    assert res.ratio(40) < 1.06 < JobSimulator.scenario("memory_caps", seed=4).run(None, 120).ratio(40)
    assert "capped at 46 samples by memory" in res.proposals[0][2]
    blind = JobSimulator.scenario("memory_caps", seed=4, measure_memory=False).run("profiled", 120)
    assert blind.oom_steps > 0  # a policy that sees no memory runs the small cards out

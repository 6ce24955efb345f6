"""Strategies: robust fits, readiness, forecasts, the registry."""

from __future__ import annotations

import random

import pytest

from backend.policy import (
    Constraints,
    DeviceSignals,
    Estimate,
    JobObservation,
    NoProposal,
    PolicyConfig,
    Proposal,
    RankObservation,
    StepSample,
    available_strategies,
    decide,
    get_strategy,
    register_strategy,
)
from backend.policy.strategies import _REGISTRY

from ._build import observe

NONE = Constraints()


def _job(ranks, shares, steps_since_change=100, version=0):
    return JobObservation(job="j", world_size=len(ranks), global_batch_size=sum(shares),
                          batch_index=len(ranks[0].steps), shares=tuple(shares),
                          placement_version=version, steps_since_change=steps_since_change,
                          ranks=tuple(ranks))


def _varied_rank(rank, a, c, steps=80, noise=0.02, seed=0, outlier_every=0, c_of_step=None,
                 device=()):
    rnd = random.Random(seed)
    out = []
    for k in range(steps):
        b = (16, 24, 32, 40)[k % 4]
        ck = c_of_step(k) if c_of_step else c
        t = (a + ck * b) * (1 + rnd.gauss(0, noise))
        if outlier_every and k % outlier_every == 1:
            t *= 3.0
        out.append(StepSample(k, b, t))
    return RankObservation(rank=rank, steps=tuple(out), device=tuple(device))


def test_profiled_fit_recovers_costs_despite_outliers():
    ranks = [_varied_rank(0, 5.0, 1.0, outlier_every=6, seed=1),
             _varied_rank(1, 2.0, 3.0, outlier_every=6, seed=2)]
    est = get_strategy("profiled")(_job(ranks, [16, 16]), PolicyConfig(), NONE)
    assert isinstance(est, Estimate)
    assert est.c_ms[0] == pytest.approx(1.0, rel=0.05)
    assert est.c_ms[1] == pytest.approx(3.0, rel=0.05)
    assert est.a_ms[0] == pytest.approx(5.0, abs=1.5)
    assert est.fit_r2[0] is not None and est.n_steps == (80, 80)


def test_profiled_fit_at_one_batch_size_is_proportional():
    obs = observe([2.0, 2.0], [1.0, 2.0], [32, 32], steps=20, noise=0.01)
    est = get_strategy("profiled")(obs, PolicyConfig(), NONE)
    assert est.a_ms == (0.0, 0.0)
    assert est.c_ms[0] == pytest.approx(34 / 32, rel=0.02)
    assert est.c_ms[1] == pytest.approx(66 / 32, rel=0.02)
    assert est.fit_r2 == (None, None)


def test_profiled_warms_up_with_steps_remaining():
    obs = observe([0, 0, 0], [1, 1, 1], [8, 8, 8], steps=10)
    short = RankObservation(rank=2, steps=obs.ranks[2].steps[:4])
    obs = _job([obs.ranks[0], obs.ranks[1], short], [8, 8, 8])
    got = decide(obs, PolicyConfig(strategy="profiled", min_steps=10))
    assert got == NoProposal("warming_up", "warming up: 6 more steps needed on rank 2",
                             steps_remaining=6)


def test_a_tight_fit_is_ready_at_half_of_min_steps_a_noisy_one_is_not():
    a, c, shares = [2.0] * 4, [2.0, 2.0, 4.0, 8.0], [16] * 4
    steady = observe(a, c, shares, steps=5, noise=0.005, seed=1)
    got = decide(steady, PolicyConfig(strategy="profiled", min_steps=10))
    assert isinstance(got, Proposal) and got.shares[3] < got.shares[0]
    assert decide(observe(a, c, shares, steps=4, noise=0.005, seed=1),
                  PolicyConfig(min_steps=10)).status == "warming_up"  # below half
    # 10% noise: a relative standard error of ~5% at 5 steps; wait for all 10.
    noisy = observe(a, c, shares, steps=5, noise=0.1, seed=1)
    got = decide(noisy, PolicyConfig(strategy="profiled", min_steps=10))
    assert got.status == "warming_up" and got.steps_remaining == 5
    # One noisy rank holds back the first proposal for everyone.
    mixed = JobObservation(job="job", world_size=4, global_batch_size=64, batch_index=4,
                           shares=tuple(shares), placement_version=0, steps_since_change=5,
                           ranks=(*steady.ranks[:3], noisy.ranks[3]))
    got = decide(mixed, PolicyConfig(strategy="predictive", min_steps=10))
    assert got == NoProposal("warming_up", "warming up: 5 more steps needed on rank 3",
                             steps_remaining=5)


def test_profiled_restarts_its_window_at_a_level_shift():
    rank = _varied_rank(0, 2.0, 1.0, steps=100, c_of_step=lambda k: 1.0 if k < 80 else 2.0)
    est = get_strategy("profiled")(_job([rank], [32]), PolicyConfig(), NONE)
    assert est.c_ms[0] == pytest.approx(2.0, rel=0.1)
    assert est.evidence["fit"][0]["restarted"] is True


def test_predictive_follows_a_rising_cost_and_device_signals():
    drift = _varied_rank(0, 2.0, 1.0, steps=60, noise=0.01, c_of_step=lambda k: 1.0 + 0.01 * k)
    flat = _varied_rank(1, 2.0, 1.0, steps=60, noise=0.01, seed=3)
    obs = _job([drift, flat], [32, 32])
    cfg = PolicyConfig(horizon_steps=20)
    prof = get_strategy("profiled")(obs, cfg, NONE)
    pred = get_strategy("predictive")(obs, cfg, NONE)
    # True c at step 59 + 20 is 1.79; profiled lags behind, predictive looks ahead.
    assert prof.c_ms[0] < 1.6
    assert pred.c_ms[0] == pytest.approx(1.79, rel=0.08)
    assert pred.c_ms[1] == prof.c_ms[1]  # no trend, no forecast

    # Clock falling with a thermal reason, step times still flat: predictive moves first.
    hot = [DeviceSignals(t=float(s), sm_clock_mhz=1980.0 - 20.0 * s, sm_clock_max_mhz=1980.0,
                         temp_c=84.0, throttle_reasons=("sw_thermal",) if s else ())
           for s in range(10)]
    ranks = [_varied_rank(0, 2.0, 1.0, steps=60, seed=4, device=hot),
             _varied_rank(1, 2.0, 1.0, steps=60, seed=5)]
    obs = _job(ranks, [32, 32])
    cfg = PolicyConfig(horizon_steps=20, params={"step_s": 0.5})
    prof = get_strategy("profiled")(obs, cfg, NONE)
    pred = get_strategy("predictive")(obs, cfg, NONE)
    assert pred.c_ms[0] > 1.1 * prof.c_ms[0]
    forecast = pred.evidence["forecasts"][0]
    assert forecast["rank"] == 0 and forecast["throttle"] == ["sw_thermal"]


def test_predictive_forecasts_a_young_drift_over_the_whole_horizon():
    # A CPU job's timing noise (0.5%) makes a 1%/step drift significant 8 to 10 steps in;
    # its forecast must still reach the horizon, where the placement it answers will live.
    # Capping the extrapolation at twice the trend's segment (16 steps here) aimed the first
    # placement at half its life: it fell 10% behind the drift before the cooldown let the
    # next one in (a real job took 51 to 55 steps to catch up, the simulator at 3% noise 27).
    def rank(i, steps):
        rnd = random.Random(i)
        return RankObservation(rank=i, steps=tuple(
            StepSample(k, 16, (2.0 + 2.0 * 16) * (1 + (0.01 * (k - 60) if i == 3 and k > 60 else 0))
                       * (1 + rnd.gauss(0, 0.005))) for k in range(steps)))

    cfg = PolicyConfig(horizon_steps=30)
    for steps in (69, 70):
        obs = _job([rank(i, steps) for i in range(4)], [16] * 4)
        pred = get_strategy("predictive")(obs, cfg, NONE)
        forecast = pred.evidence["forecasts"][0]
        assert forecast["rank"] == 3 and forecast["trend_steps"] < 15  # a young trend
        true_ahead = (2.0 + 2.0 * 16) / 16 * (1 + 0.01 * (steps - 1 + 30 - 60))
        assert pred.c_ms[3] == pytest.approx(true_ahead, rel=0.05)


def test_predictive_forecasts_from_the_jobs_batch_index_not_from_the_ranks_last_frame():
    # Metrics reach the backend in frames (every 5 steps or 0.5 s): the drifting rank's
    # newest step can trail the job's batch index, and the placement lives from there on.
    def rank(i, steps):
        rnd = random.Random(i)
        return RankObservation(rank=i, steps=tuple(
            StepSample(k, 16, (2.0 + 2.0 * 16) * (1 + (0.01 * (k - 60) if i == 3 and k > 60 else 0))
                       * (1 + rnd.gauss(0, 0.002))) for k in range(steps)))

    ranks = [rank(i, 90) for i in range(3)] + [rank(3, 80)]  # rank 3's last 10 steps in flight
    obs = _job(ranks, [16] * 4)
    assert obs.batch_index == 90
    pred = get_strategy("predictive")(obs, PolicyConfig(horizon_steps=30), NONE)
    true_ahead = (2.0 + 2.0 * 16) / 16 * (1 + 0.01 * (90 + 30 - 60))
    assert pred.c_ms[3] == pytest.approx(true_ahead, rel=0.03)


def test_registry_takes_functions_and_classes():
    def halves(obs, config, constraints):
        return Estimate(a_ms=(0.0, 0.0), c_ms=(1.0, 2.0))

    class Thirds:
        def estimate(self, obs, config, constraints):
            return Estimate(a_ms=(0.0, 0.0), c_ms=(1.0, 3.0))

    try:
        register_strategy("halves", halves)
        register_strategy("thirds", Thirds)
        assert {"halves", "thirds", "static", "profiled", "predictive"} <= set(
            available_strategies())
        obs = observe([0, 0], [1, 1], [6, 6], steps=5)
        got = decide(obs, PolicyConfig(strategy="thirds"))
        assert isinstance(got, Proposal) and got.shares == (9, 3)
        assert got.explanation.strategy == "thirds"
        assert decide(obs, PolicyConfig(strategy="halves")).shares == (8, 4)
    finally:
        _REGISTRY.pop("halves", None)
        _REGISTRY.pop("thirds", None)
    with pytest.raises(ValueError, match="unknown strategy 'nope'; available: predictive, "):
        get_strategy("nope")
    with pytest.raises(ValueError, match="must be a function or a class, got int"):
        register_strategy("bad", 3)


def test_predictive_ignores_a_card_that_runs_hot_but_steady():
    steady = [DeviceSignals(t=float(s), sm_clock_mhz=1980.0, sm_clock_max_mhz=1980.0,
                            temp_c=84.0 + (0.3 if s % 2 else -0.3)) for s in range(30)]
    climbing = [DeviceSignals(t=float(s), sm_clock_mhz=1980.0, sm_clock_max_mhz=1980.0,
                              temp_c=70.0 + 0.5 * s) for s in range(30)]
    cfg = PolicyConfig(horizon_steps=20, params={"step_s": 1.0})
    for device, slower in ((steady, False), (climbing, True)):
        ranks = [_varied_rank(0, 2.0, 1.0, steps=60, seed=6, device=device),
                 _varied_rank(1, 2.0, 1.0, steps=60, seed=7)]
        obs = _job(ranks, [32, 32])
        prof = get_strategy("profiled")(obs, cfg, NONE)
        pred = get_strategy("predictive")(obs, cfg, NONE)
        assert (pred.c_ms[0] > prof.c_ms[0]) is slower


def test_garbage_measurements_are_skipped_not_fatal():
    import json
    from dataclasses import asdict

    bad_steps = tuple(StepSample(k, b, t) for k, (b, t) in enumerate(
        [(0, 5.0), (-3, 5.0), (8, float("nan")), (8, float("inf")), (8, -1.0)] * 3))
    good = _varied_rank(0, 2.0, 1.0, steps=40, seed=8)
    weird_dev = tuple(DeviceSignals(t=float(s), sm_clock_mhz=float("nan"), sm_clock_max_mhz=0.0,
                                    temp_c=float("inf")) for s in range(10))
    ranks = [RankObservation(rank=0, steps=good.steps + bad_steps, device=weird_dev),
             _varied_rank(1, 2.0, 3.0, steps=40, seed=9)]
    obs = _job(ranks, [16, 16])
    for name in ("profiled", "predictive"):
        got = decide(obs, PolicyConfig(strategy=name))
        assert got.explanation is not None
        json.dumps(asdict(got.explanation), allow_nan=False)

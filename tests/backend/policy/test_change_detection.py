"""Change detection on recorded step series: shifts found within a few steps, single
outliers and noise never."""

from __future__ import annotations

import random

import numpy as np
import pytest

from backend.policy import StepSample
from backend.policy._fit import SHIFT_STEPS, detect_shift, fit_steps


def _series(n: int, *, noise: float = 0.03, seed: int = 0, level=lambda k: 1.0,
            outliers: dict[int, float] | None = None, b: int = 32) -> list[StepSample]:
    rnd = random.Random(seed)
    out = []
    for k in range(n):
        t = (2.0 + level(k) * b) * (1 + rnd.gauss(0, noise))
        if outliers and k in outliers:
            t *= outliers[k]
        out.append(StepSample(k, b, t))
    return out


@pytest.mark.parametrize("factor", [1.5, 2.0, 4.0, 0.5])
def test_a_level_shift_is_found_three_steps_after_it(factor):
    for after in range(0, SHIFT_STEPS):
        fit = fit_steps(_series(60 + after, level=lambda k: 1.0 if k < 60 else factor))
        assert not fit.restarted  # fewer than three steps at the new level: not yet
    fit = fit_steps(_series(60 + SHIFT_STEPS, level=lambda k: 1.0 if k < 60 else factor))
    assert fit.restarted and fit.start == 60 and fit.n == SHIFT_STEPS
    assert fit.c_ms == pytest.approx((2.0 + 32 * factor) / 32, rel=0.06)


def test_an_old_shift_in_the_window_is_cut_where_it_happened():
    # 70 of 100 steps at the new level: the old ones are the odd ones out.
    fit = fit_steps(_series(100, level=lambda k: 1.0 if k < 30 else 2.0))
    assert fit.restarted and fit.start == 30


@pytest.mark.parametrize("seed", range(5))
def test_a_single_10x_outlier_moves_nothing(seed):
    clean = fit_steps(_series(80, seed=seed))
    for at in (40, 77, 79):
        fit = fit_steps(_series(80, seed=seed, outliers={at: 10.0}))
        assert not fit.restarted
        assert fit.c_ms == pytest.approx(clean.c_ms, rel=0.02)
    # Two outliers a few steps apart (a checkpoint, then a GC pause) do not make a shift.
    assert not fit_steps(_series(80, seed=seed, outliers={70: 10.0, 73: 8.0})).restarted


@pytest.mark.parametrize("noise", [0.03, 0.05, 0.08])
def test_pure_noise_is_never_a_shift(noise):
    for seed in range(20):
        assert not fit_steps(_series(200, noise=noise, seed=seed)).restarted


def test_a_small_change_below_the_threshold_is_not_a_shift():
    fit = fit_steps(_series(100, noise=0.01, level=lambda k: 1.0 if k < 80 else 1.05))
    assert not fit.restarted


def test_detect_shift_on_residuals():
    rel = np.array([0.0] * 20 + [1.0] * 3)
    assert detect_shift(rel, 0.03) == 20
    assert detect_shift(rel[:-1], 0.03) is None
    assert detect_shift(np.array([0.0] * 20 + [9.0] + [0.0] * 5), 0.03) is None
    assert detect_shift(np.array([-0.5] * 10 + [0.0] * 20), 0.03) == 10


def _cooling_job(shift_from: int, *, effective: int = 100, now: int = 109):
    from backend.policy import JobObservation, RankObservation

    ranks = []
    for i in range(4):
        rows = _series(now + 1, seed=i, noise=0.02,
                       level=(lambda k: 2.0 if k >= shift_from else 1.0) if i == 1 else (lambda k: 1.0))
        ranks.append(RankObservation(rank=i, steps=tuple(rows)))
    return JobObservation(job="j", world_size=4, global_batch_size=128, batch_index=now,
                          shares=(32, 32, 32, 32), placement_version=2,
                          steps_since_change=now - effective, ranks=tuple(ranks))


def test_a_shift_after_the_placement_took_effect_ends_the_cooldown():
    from backend.policy import PolicyConfig, Proposal, decide

    got = decide(_cooling_job(shift_from=105), PolicyConfig(cooldown_steps=20))
    assert isinstance(got, Proposal) and got.shares[1] < 32
    assert got.explanation.evidence["cooldown_ended_by_shift"] == [1]
    # Steady ranks in cooldown wait it out; so does a change that began with the placement.
    assert decide(_cooling_job(shift_from=10_000), PolicyConfig(cooldown_steps=20)).status == "cooldown"
    assert decide(_cooling_job(shift_from=100), PolicyConfig(cooldown_steps=20)).status == "cooldown"


def _drifting_job(*, effective: int, now: int = 110, drift_from: int = 60):
    from backend.policy import JobObservation, RankObservation

    ranks = []
    for i in range(4):
        level = (lambda k: 1.0 + 0.01 * max(0, k - drift_from)) if i == 1 else (lambda k: 1.0)
        ranks.append(RankObservation(rank=i, steps=tuple(_series(now + 1, seed=i, noise=0.01,
                                                                    level=level))))
    return JobObservation(job="j", world_size=4, global_batch_size=128, batch_index=now,
                          shares=(32, 32, 32, 32), placement_version=2,
                          steps_since_change=now - effective, ranks=tuple(ranks))


def test_a_significant_trend_ends_the_cooldown_once_the_placement_settled():
    from backend.policy import PolicyConfig, Proposal, decide

    cfg = PolicyConfig(strategy="predictive", cooldown_steps=20)
    got = decide(_drifting_job(effective=100), cfg)
    assert isinstance(got, Proposal) and got.shares[1] < 32
    assert got.explanation.evidence["cooldown_ended_by_trend"] == [1]
    # Not in the first steps of the placement (its own switch), not without a trend
    # (profiled fits no trend), and not for steady ranks.
    assert decide(_drifting_job(effective=107), cfg).status == "cooldown"
    assert decide(_drifting_job(effective=100), PolicyConfig(cooldown_steps=20)).status == "cooldown"
    assert decide(_drifting_job(effective=100, drift_from=10_000), cfg).status == "cooldown"

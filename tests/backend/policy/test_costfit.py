"""The fitted cost model: step time = c + a*sum(L) + b*sum(L^2), non-negative (issue 23, item 2)."""

from __future__ import annotations

import math
import random
from itertools import pairwise

import pytest

from backend.policy.costfit import MIN_STEPS, fit_cost, sample_cost


def _batches(rng: random.Random, steps: int, a: float, b: float, c: float, noise: float,
             *, equal: bool = False) -> tuple[list[float], list[float], list[float]]:
    s1, s2, t = [], [], []
    for _ in range(steps):
        n = rng.randint(4, 24)
        if equal:
            lens = [512.0] * n
        else:  # chat turns and long documents: a heavy tail
            lens = [float(rng.randint(20, 200)) if rng.random() < 0.8 else float(rng.randint(1000, 6000))
                    for _ in range(n)]
        x1, x2 = sum(lens), sum(v * v for v in lens)
        s1.append(x1)
        s2.append(x2)
        t.append((c + a * x1 + b * x2) * (1 + rng.gauss(0, noise)))
    return s1, s2, t


def test_recovers_a_and_b_from_noisy_steps() -> None:
    a, b, c = 0.002, 4e-7, 3.0
    s1, s2, t = _batches(random.Random(1), 60, a, b, c, noise=0.03)
    fit = fit_cost(s1, s2, t)
    assert fit is not None and fit.model == "quadratic", fit
    assert fit.a_ms == pytest.approx(a, rel=0.25) and fit.b_ms == pytest.approx(b, rel=0.15)
    assert fit.r2 > 0.95 and fit.n_steps == 60
    assert all(x >= 0 for x in (fit.a_ms, fit.b_ms, fit.c_ms))
    # A long sample weighs more than its length: the hook's partition sees the quadratic term.
    assert sample_cost(fit, 4000) / sample_cost(fit, 100) > 40 * 1.5
    assert fit.as_dict()["model"] == "quadratic"


def test_linear_data_keeps_the_linear_model() -> None:
    s1, s2, t = _batches(random.Random(2), 60, 0.003, 0.0, 2.0, noise=0.03)
    fit = fit_cost(s1, s2, t)
    assert fit is not None and fit.model == "linear" and fit.b_ms == 0.0
    assert fit.a_ms == pytest.approx(0.003, rel=0.1)
    assert sample_cost(fit, 4000) == 4000.0  # linear: weighs by length, the partition unchanged


def test_degenerate_lengths_fall_back_to_linear_and_too_few_steps_give_no_fit() -> None:
    # Equal lengths: sum(L^2) = 512 * sum(L) in every batch, the quadratic term is not identifiable.
    s1, s2, t = _batches(random.Random(3), 40, 0.002, 4e-7, 1.0, noise=0.01, equal=True)
    fit = fit_cost(s1, s2, t)
    assert fit is not None and fit.model == "linear" and "not identifiable" in fit.note
    assert fit_cost(s1[:MIN_STEPS - 1], s2[:MIN_STEPS - 1], t[:MIN_STEPS - 1]) is None
    assert fit_cost([100.0] * 10, [1e4] * 10, [5.0] * 10) is None  # nothing varies: nothing to fit
    assert sample_cost(None, 300) == 300.0


def test_the_shared_k_is_b_over_a_for_ranks_of_different_speeds_and_refuses_bad_input() -> None:
    from backend.policy.costfit import K_MIN, shared_length_sq_weight
    from rebalancer_wire.protocol import MAX_LENGTH_SQ_WEIGHT

    rng = random.Random(11)
    ranks = [_batches(rng, 40, 0.002 / speed, 1e-6 / speed, 2.0, noise=0.01) for speed in (1.0, 0.6, 0.3)]
    assert shared_length_sq_weight(ranks) == pytest.approx(1e-6 / 0.002, rel=0.05)
    s1, s2, _ = ranks[0]
    assert shared_length_sq_weight([(s1, s2, [2.0 + 0.002 * x for x in s1])]) == K_MIN  # linear: the least k
    assert shared_length_sq_weight([(s1, s2, [2.0 + 1e-6 * x for x in s2])]) == MAX_LENGTH_SQ_WEIGHT  # L^2 alone
    with pytest.raises(ValueError, match="at least"):
        shared_length_sq_weight([(s1[:3], s2[:3], s1[:3])])
    with pytest.raises(ValueError, match="finite"):
        shared_length_sq_weight([(s1, s2, [math.nan] * len(s1))])
    with pytest.raises(ValueError, match="differ in length"):
        shared_length_sq_weight([(s1, s2[:-1], s1)])


def test_bad_input_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="step_ms must be finite"):
        fit_cost([1.0] * 8, [1.0] * 8, [1.0] * 7 + [math.nan])
    with pytest.raises(ValueError, match="differ in length"):
        fit_cost([1.0] * 8, [1.0] * 8, [1.0] * 7)
    with pytest.raises(ValueError, match="sum_l must be finite and >= 0"):
        fit_cost([-1.0] * 8, [1.0] * 8, [1.0] * 8)
    with pytest.raises(ValueError, match="window"):
        fit_cost([1.0] * 8, [1.0] * 8, [1.0] * 8, window=2)
    with pytest.raises(ValueError, match="sample length"):
        sample_cost(None, -3)


# --- the job's cost model: which one the policy uses (work.job_cost_model) ---------------

def _observation(b: float, *, lengths: bool = True, steps: int = 40, speeds: tuple[float, ...] = (1.0, 0.5)):
    from backend.policy.types import JobObservation, RankObservation, StepSample

    rng = random.Random(7)
    fits = [_batches(rng, steps, 0.002 / speed, b / speed, 1.0, noise=0.02) for speed in speeds]
    b1 = [sum(f[0][k] for f in fits) for k in range(steps)]  # the global batch's work: every rank's
    b2 = [sum(f[1][k] for f in fits) for k in range(steps)]
    ranks = []
    for r, (s1, s2, t) in enumerate(fits):
        rows = tuple(StepSample(k, 8, t[k], s1[k], b1[k], s2[k] if lengths else None,
                                b2[k] if lengths else None) for k in range(steps))
        ranks.append(RankObservation(rank=r, steps=rows))
    return JobObservation(job="j", world_size=len(speeds), global_batch_size=16, batch_index=steps,
                          shares=(8, 8), placement_version=0, steps_since_change=steps, ranks=tuple(ranks))


def test_job_cost_model_picks_the_fit_only_where_it_explains_the_step_times_better() -> None:
    from backend.policy import PolicyConfig, decide
    from backend.policy.costfit import (
        MODEL_FITTED,
        MODEL_LINEAR,
        MODEL_SAMPLES,
        SPLIT_SHIFT,
        cost_model_moved,
    )
    from backend.policy.work import job_cost_model, mean_batch_work

    quad = job_cost_model(_observation(4e-7))
    assert quad.model == MODEL_FITTED and quad.ranks_fitted == quad.ranks_quadratic == 2
    assert quad.length_sq_weight == pytest.approx(4e-7 / 0.002, rel=0.3)  # k = b/a
    assert quad.r2 is not None and quad.r2 > 0.95 and "L + " in quad.detail
    lin = job_cost_model(_observation(0.0))
    assert lin.model == MODEL_LINEAR and lin.length_sq_weight == 0.0 and lin.ranks_quadratic == 0
    assert lin.r2 is not None and lin.r2 > 0.9
    per_sample = job_cost_model(_observation(4e-7, lengths=False))  # sample_cost: no squares
    assert per_sample.model == MODEL_LINEAR and per_sample.ranks_fitted == 2
    few = job_cost_model(_observation(4e-7, steps=MIN_STEPS + 2))  # too few steps to trust b
    assert few.model == MODEL_LINEAR
    from dataclasses import replace
    obs = _observation(4e-7)
    bare = replace(obs, ranks=tuple(replace(r, steps=tuple(replace(s, work=None, batch_work=None,
                                                                    work_sq=None, batch_work_sq=None)
                                                            for s in r.steps)) for r in obs.ranks))
    assert job_cost_model(bare).model == MODEL_SAMPLES
    # decide() carries the model and measures work as sum(L) + k*sum(L^2) under it.
    d = decide(obs, PolicyConfig(min_steps=5))
    assert d.cost_model == quad
    assert mean_batch_work(obs, quad.length_sq_weight) > mean_batch_work(obs)  # type: ignore[operator]
    assert decide(bare, PolicyConfig(min_steps=5)).cost_model is None
    # A new placement is worth it where the model moves a rank's share of a batch's work by
    # more than SPLIT_SHIFT from the k in force: the fit where the length is in force, another
    # k that far away, or the length again once no rank needs the quadratic term.
    k = quad.length_sq_weight
    assert quad.split_shift is not None and quad.split_shift > SPLIT_SHIFT
    assert cost_model_moved(0.0, quad) and not cost_model_moved(0.0, lin) and lin.split_shift == 0.0
    # With k in force, the F test alone keeps a rank counting, and at least half the fitted
    # ranks keep the model: one of the two passes it on this linear data by chance, so the
    # fit stays, and the job view names what the hooks split by (the project's CI once read
    # `work (linear)` while a fitted k stayed in force: one rank of two kept it).
    kept = job_cost_model(replace(_observation(0.0), length_sq_weight=k))
    assert kept.ranks_quadratic == 1 and kept.model == MODEL_FITTED and kept.length_sq_weight > 0
    back = job_cost_model(replace(_observation(0.0, speeds=(1.0, 0.5, 0.7)), length_sq_weight=k))
    assert back.ranks_quadratic < 1.5 and back.model == MODEL_LINEAR  # fewer than half: the length again
    assert back.split_shift is not None and back.split_shift > SPLIT_SHIFT and cost_model_moved(k, back)
    near = job_cost_model(replace(obs, length_sq_weight=k * 1.2))  # a refit 20% from the k in force
    assert near.model == MODEL_FITTED and near.split_shift is not None and near.split_shift < SPLIT_SHIFT
    assert not cost_model_moved(k * 1.2, near)
    far = job_cost_model(replace(obs, length_sq_weight=k / 4))
    assert far.split_shift is not None and far.split_shift > SPLIT_SHIFT and cost_model_moved(k / 4, far)


def test_a_linear_term_near_zero_gives_a_k_the_wire_accepts() -> None:
    from backend.policy.costfit import MODEL_FITTED
    from backend.policy.work import job_cost_model
    from rebalancer_wire.protocol import MAX_LENGTH_SQ_WEIGHT, Placement, decode, encode

    obs = _observation(4e-7)
    # Pure attention: no per-token term at all, so b/a is as large as the noise makes it.
    from dataclasses import replace
    rng = random.Random(5)
    ranks = tuple(replace(r, steps=tuple(replace(s, compute_ms=(1.0 + 4e-7 * s.work_sq) * (1 + rng.gauss(0, 0.001)))
                                         for s in r.steps)) for r in obs.ranks)
    model = job_cost_model(replace(obs, ranks=ranks))
    assert model.model == MODEL_FITTED and 0 < model.length_sq_weight <= MAX_LENGTH_SQ_WEIGHT
    exact = tuple(replace(r, steps=tuple(replace(s, compute_ms=1.0 + 4e-7 * s.work_sq) for s in r.steps))
                  for r in obs.ranks)  # noiseless: the fit puts a at 0 exactly
    model = job_cost_model(replace(obs, ranks=exact))
    assert model.model == MODEL_FITTED and model.length_sq_weight == MAX_LENGTH_SQ_WEIGHT
    msg = Placement(job="j", version=1, shares=[8, 8], global_batch_size=16, length_sq_weight=model.length_sq_weight)
    assert decode(encode(msg)) == msg


# --- the cost model under a loaded machine's noise: no switch on noise, one on a real term --

def _sleep_job(seed: int, a: float, b: float, *, ranks: int, share: int, steps: int = 120, every: int = 5,
               late_ms: float = 1.0, stalls: float = 0.05):
    """A job as ``tests/backend/_lengths_worker.py`` runs it (chat turns and every fifth sample
    a 1,000-3,000-token document, shuffled), its step times as sleeps measure them on a loaded
    machine: a wake-up ``late_ms`` late on average, and a share ``stalls`` of the steps stalled
    up to 30 ms. The policy looks every ``every`` steps, as a metrics frame arrives, and the
    controller puts what it says in force (``cost_model_moved``). Returns the k in force after
    each look."""
    from backend.policy.costfit import cost_model_moved
    from backend.policy.types import JobObservation, RankObservation, StepSample
    from backend.policy.work import job_cost_model

    rng = random.Random(seed)
    lengths = [1000 + (i * 389) % 2000 if i % 5 == 0 else 20 + (i * 37) % 180 for i in range(512)]
    order = list(range(512))
    rng.shuffle(order)
    rows: list[list[StepSample]] = [[] for _ in range(ranks)]
    in_force, seen = 0.0, []
    for k in range(steps):
        batch = [lengths[order[(k * ranks * share + j) % 512]] for j in range(ranks * share)]
        b1, b2 = float(sum(batch)), float(sum(v * v for v in batch))
        for r in range(ranks):
            lens = batch[r * share:(r + 1) * share]
            s1, s2 = float(sum(lens)), float(sum(v * v for v in lens))
            late = rng.expovariate(1.0 / late_ms) + (rng.uniform(0, 30) if rng.random() < stalls else 0.0)
            rows[r].append(StepSample(k, share, 1.0 + a * s1 + b * s2 + late, s1, b1, s2, b2))
        if k % every or k < 6:
            continue
        obs = JobObservation(job="j", world_size=ranks, global_batch_size=ranks * share, batch_index=k,
                             shares=(share,) * ranks, placement_version=0, steps_since_change=k,
                             ranks=tuple(RankObservation(rank=r, steps=tuple(rows[r][-100:])) for r in range(ranks)),
                             length_sq_weight=in_force)
        model = job_cost_model(obs)
        if cost_model_moved(in_force, model):
            in_force = model.length_sq_weight
        seen.append(in_force)
    return seen


def _switches(seen: list[float]) -> int:
    return sum(1 for x, y in pairwise([0.0, *seen]) if (x > 0) != (y > 0))


def test_a_linear_cost_under_a_loaded_machines_noise_never_switches_to_the_fitted_model() -> None:
    # A cost linear in length (the e2e test's single-rank job): the F test alone, asked at
    # every look, found a quadratic term in the noise on 1 run in 15 (a fitted k sent, then
    # taken back). The term must clear a margin with the slowest step left out.
    switched = [seed for seed in range(100) if any(_sleep_job(seed, 0.01, 0.0, ranks=1, share=8))]
    assert switched == []


def test_a_quadratic_cost_is_fitted_at_the_first_look_and_kept_through_noisy_windows() -> None:
    # The e2e test's quadratic job: 2 ranks of 4 samples, a 2,000-token document costing 40 ms
    # of attention beside 4 ms linear. The linear term is small beside the noise, so refits
    # put k = b/a anywhere from 0.002 to the wire's bound; a k more than 25% from the one in
    # force was sent every time (9 placements in 200 steps on average). What the split cares
    # about is the share of work each rank gets, and that moves little once k*L >> 1.
    from backend.policy.work import MIN_FIT_STEPS

    sends = []
    for seed in range(30):
        seen = _sleep_job(seed, 0.002, 1e-5, ranks=2, share=4)
        first = next(i for i, k in enumerate(seen) if k > 0)
        assert 6 + 5 * first <= MIN_FIT_STEPS + 5, (seed, seen)  # the first look with enough steps
        assert _switches(seen) == 1, (seed, seen)  # never taken back
        sends.append(sum(1 for x, y in pairwise([0.0, *seen]) if x != y))
    assert max(sends) <= 3 and sum(sends) <= 1.5 * len(sends), sends


def test_the_k_put_in_force_under_a_loaded_machines_noise_is_near_b_over_a() -> None:
    # The project's CI (2-rank quadratic job, steps swinging 42-84 ms): the first k put in
    # force was the wire's bound, 1e6, for a true b/a of 0.005. Each rank's own fit put its
    # small linear term at 0 or near it in that noise, and k was the median of the ranks' b/a.
    # The ranks share one cost shape: k is fitted once over all of them, each with its own
    # speed, and a step slowed by the machine (they only ever run late) does not pull the fit.
    # Within 4x (the per-token term is a few ms beside this noise; the job page's e2e test asks
    # the same), on mild noise and on heavy (3 ms late on average, one step in five stalled).
    within, first_ks = 0, []
    cases = [(seed, late, stalls) for seed in range(12) for late, stalls in ((1.0, 0.05), (3.0, 0.2))]
    for seed, late, stalls in cases:
        seen = _sleep_job(seed, 0.002, 1e-5, ranks=2, share=4, late_ms=late, stalls=stalls)
        ks = [k for k in seen if k > 0]
        if not ks:
            continue  # the heavier noise may keep the length alone: nothing put in force
        first_ks.append(ks[0])
        within += all(0.005 / 4 < k < 0.005 * 4 for k in ks)
    assert len(first_ks) >= len(cases) // 2, first_ks
    assert within == len(first_ks), sorted(first_ks)

"""decide: cooldown, hysteresis, guardrails, explanations, memory caps."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.policy import (
    Constraints,
    MemoryFit,
    NoProposal,
    PolicyConfig,
    Proposal,
    RankMemory,
    check_placement,
    decide,
    limit_moves,
    memory_caps,
    solve,
)

from ._build import observe

SLOW_RANK3 = dict(a=[4.0, 4.0, 4.0, 4.0], c=[1.0, 1.0, 1.0, 2.5])


def test_proposal_explains_itself():
    obs = observe(SLOW_RANK3["a"], SLOW_RANK3["c"], [32, 32, 32, 32], steps=30, noise=0.01)
    got = decide(obs, PolicyConfig(strategy="profiled"))
    assert isinstance(got, Proposal)
    assert sum(got.shares) == 128 and got.shares[3] < 32
    ex = got.explanation
    assert ex.strategy == "profiled"
    assert ex.step_ms_before == pytest.approx(84.0, rel=0.03)
    assert ex.step_ms_after < 0.8 * ex.step_ms_before
    assert ex.gain == pytest.approx(1 - ex.step_ms_after / ex.step_ms_before)
    assert [r.share_after for r in ex.ranks] == list(got.shares)
    assert ex.ranks[3].compute_ms_before == pytest.approx(ex.step_ms_before)
    assert ex.evidence["steps_used"] == [30, 30, 30, 30]
    moved = 32 - got.shares[3]
    assert got.reason == (
        f"rank 3 is {ex.ranks[3].c_ms / ex.ranks[0].c_ms:.1f}x slower per sample than the "
        f"median; moving {moved} samples from rank 3 to ranks 0-2 cuts the predicted step "
        f"from {ex.step_ms_before:.1f} ms to {ex.step_ms_after:.1f} ms ({ex.gain:.0%})"
    )


def test_cooldown_after_a_change_but_not_at_version_zero():
    obs = observe(SLOW_RANK3["a"], SLOW_RANK3["c"], [32, 32, 32, 32], steps=30, version=3,
                  steps_since_change=12)
    got = decide(obs, PolicyConfig(cooldown_steps=20))
    assert got == NoProposal("cooldown", "cooldown: 8 more steps after placement v3",
                             steps_remaining=8)
    obs = observe(SLOW_RANK3["a"], SLOW_RANK3["c"], [32, 32, 32, 32], steps=30, version=0,
                  steps_since_change=12)
    assert isinstance(decide(obs, PolicyConfig(cooldown_steps=20)), Proposal)


def test_balanced_and_insufficient_gain():
    # Already at the optimum: balanced.
    a, c = [4.0, 4.0, 4.0, 4.0], [1.0, 1.0, 1.0, 2.0]
    best = solve(a, c, 128)
    got = decide(observe(a, c, best, steps=30), PolicyConfig())
    assert got.status == "balanced" and got.explanation is not None
    # A 3% imbalance stays below the 5% threshold.
    got = decide(observe([0.0] * 4, [1.0, 1.0, 1.0, 1.06], [32] * 4, steps=30), PolicyConfig())
    assert got.status == "insufficient_gain"
    assert got.detail.startswith("predicted gain 2.")
    assert got.detail.endswith("is below the 5% threshold")


def test_noise_margin_raises_the_bar():
    # An 8% predicted gain, but 30% noise: not a stable estimate, no proposal.
    obs = observe([0.0] * 4, [1.0, 1.0, 1.0, 1.12], [32] * 4, steps=40, noise=0.3, seed=4)
    got = decide(obs, PolicyConfig(min_steps=10))
    assert isinstance(got, NoProposal), got
    assert got.status == "insufficient_gain"
    assert "for measurement noise" in got.detail
    # The same imbalance measured cleanly is proposed.
    obs = observe([0.0] * 4, [1.0, 1.0, 1.0, 1.12], [32] * 4, steps=40, noise=0.01, seed=4)
    assert isinstance(decide(obs, PolicyConfig(min_steps=10)), Proposal)


def test_noisy_ranks_are_held_until_their_estimate_settles():
    # Rank 1 is slow and clean, rank 3 looks fast but is noisy and has few steps.
    a, c = [0.0] * 4, [1.0, 1.5, 1.0, 1.0]
    clean = observe(a, c, [32] * 4, steps=12, noise=0.01, seed=1)
    noisy = observe(a, c, [32] * 4, steps=12, noise=0.4, seed=2)
    obs = dataclasses.replace(clean, ranks=(*clean.ranks[:3], noisy.ranks[3]))
    got = decide(obs, PolicyConfig(min_steps=10))
    assert isinstance(got, Proposal)
    assert got.shares[3] == 32 and got.shares[1] < 32
    assert got.explanation.evidence["held_noisy_ranks"] == [3]


def test_max_move_fraction_limits_each_rank():
    obs = observe([0.0] * 4, [1.0, 1.0, 1.0, 4.0], [64] * 4, steps=30)
    free = decide(obs, PolicyConfig())
    capped = decide(obs, PolicyConfig(max_move_fraction=0.05))  # 12 of 256
    assert isinstance(free, Proposal) and isinstance(capped, Proposal)
    assert max(abs(s - 64) for s in free.shares) > 12
    assert max(abs(s - 64) for s in capped.shares) <= 12 and sum(capped.shares) == 256
    assert capped.explanation.evidence["limited_by_max_move"] == 12


def test_limit_moves_keeps_sum_bounds_and_granularity():
    cons = Constraints(granularity=4, caps={0: 80})
    # Rank 3 may give only 8, so the others share 8 in steps of 4.
    assert limit_moves([64, 64, 64, 64], [80, 80, 80, 16], 8, cons) == (64, 68, 68, 56)
    assert limit_moves([64, 64, 64, 64], [72, 72, 56, 56], 8, cons) == (72, 72, 56, 56)
    # A drain beats the guardrail.
    cons = Constraints(drains=frozenset({3}))
    got = limit_moves([64, 64, 64, 64], [86, 85, 85, 0], 8, cons)
    assert got == (86, 85, 85, 0)
    with pytest.raises(ValueError, match="current sums to 10 but target sums to 12"):
        limit_moves([5, 5], [6, 6], 2)


def test_constraint_violation_is_fixed_even_in_cooldown_and_warm_up():
    obs = observe([0.0] * 4, [1.0] * 4, [32] * 4, steps=3, version=2, steps_since_change=3)
    got = decide(obs, PolicyConfig(), Constraints(drains=frozenset({1})))
    assert isinstance(got, Proposal)
    assert got.shares[1] == 0 and sum(got.shares) == 128
    assert got.reason.startswith("the placement in force breaks a constraint (rank 1 is "
                                 "drained but has 32 samples)")


def test_memory_caps_from_the_fit():
    gib = 2**30
    fit = MemoryFit(4.0 * gib, 1.0 * gib, None, 10, 2, "linear", 36 * gib, 32)
    obs = observe([0.0, 0.0], [1.0, 3.0], [32, 32], steps=20,
                  memory=[RankMemory("cuda", fit, 80 * 10**9), RankMemory("cuda", fit, 40 * 10**9)])
    assert memory_caps(obs) == {0: int((0.9 * 80 * 10**9 - 4 * gib) // gib),
                                1: int((0.9 * 40 * 10**9 - 4 * gib) // gib)}
    fit2 = MemoryFit(0.0, 2.0 * gib, None, 10, 2, "linear", 32 * gib, 16)
    obs = observe([0.0, 0.0], [1.0, 1.0], [16, 16], steps=20,
                  memory=[RankMemory("cuda", fit2, 80 * gib), RankMemory("cuda", fit2, 20 * gib)])
    got = decide(obs, PolicyConfig())
    assert isinstance(got, Proposal)  # rank 1 can hold only 9 samples
    assert got.shares == (23, 9)
    assert "rank 1 has 16 samples outside its bounds 0-9" in got.reason
    r1 = got.explanation.ranks[1]
    assert (r1.mem_peak_before_bytes, r1.mem_peak_after_bytes, r1.mem_cap) == (32 * gib, 18 * gib, 9)
    assert r1.mem_limit_bytes == 0.9 * 20 * gib
    with pytest.raises(ValueError, match=r"memory_headroom must be a fraction in \[0, 1\), got 1.5"):
        memory_caps(obs, headroom=1.5)


def test_infeasible_constraints_are_reported_not_raised():
    obs = observe([0.0] * 2, [1.0] * 2, [8, 8], steps=20)
    got = decide(obs, PolicyConfig(), Constraints(caps={0: 2, 1: 2}))
    assert got == NoProposal("infeasible", "caps sum to 4 < global batch 16 on ranks 0, 1.")


def test_bad_observation_is_a_clear_value_error():
    obs = observe([0.0] * 2, [1.0] * 2, [8, 8], steps=5)
    from dataclasses import replace
    with pytest.raises(ValueError, match="shares sum to 16, not the global batch 20"):
        decide(replace(obs, global_batch_size=20), PolicyConfig())


def test_static_proposes_before_any_measurement():
    obs = observe([0.0] * 4, [1.0] * 4, [64] * 4, steps=0,
                  device_types=["H100", "H100", "A100-80GB", "A100-80GB"])
    got = decide(obs, PolicyConfig(strategy="static"))
    assert isinstance(got, Proposal)
    assert got.shares[0] > got.shares[2]
    assert got.explanation.evidence["units"] == "relative"
    assert got.reason.startswith("device power differs across ranks; moving ")
    # Profiled cannot say anything yet.
    assert decide(obs, PolicyConfig(strategy="profiled")).status == "warming_up"


def test_explanation_is_plain_json():
    import dataclasses
    import json

    obs = observe(SLOW_RANK3["a"], SLOW_RANK3["c"], [32, 32, 32, 32], steps=30, noise=0.02)
    for strategy in ("static", "profiled", "predictive"):
        got = decide(obs, PolicyConfig(strategy=strategy))
        expl = got.explanation
        if expl is not None:
            json.dumps(dataclasses.asdict(expl), allow_nan=False)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (PolicyConfig(min_gain=-0.1), "policy.min_gain must be a number between 0 and 0.99, got -0.1."),
        (PolicyConfig(cooldown_steps=-1), "policy.cooldown_steps must be an integer between 0 and 1000000, got -1."),
        (PolicyConfig(min_steps=50, window_steps=20),
         "policy.window_steps (20) must be at least policy.min_steps (50)."),
        (PolicyConfig(max_move_fraction=2.0),
         "policy.max_move_fraction must be a number between 0.001 and 1, got 2.0 (or None)."),
        (PolicyConfig(strategy="fastest"), "unknown strategy 'fastest'; available: "),
        (PolicyConfig(strategy="static", workload="nlp"), "unknown workload 'nlp'; expected one"),
    ],
)
def test_bad_config_is_a_clear_value_error(config, message):
    obs = observe([0.0] * 2, [1.0] * 2, [8, 8], steps=12)
    with pytest.raises(ValueError) as err:
        decide(obs, config)
    assert str(err.value).startswith(message)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.integers(0, 64), st.sampled_from([1, 1, 2, 4]),
       st.integers(0, 24), st.randoms(use_true_random=False))
def test_limit_moves_properties(n, per_rank, g, max_move, rnd):
    b_total = n * per_rank * g
    cons = Constraints(granularity=g, caps={0: b_total} if n > 1 else {})
    current = solve([0.0] * n, [1.0] * n, b_total, cons)
    c = [rnd.choice([0.5, 1.0, 2.0, 4.0]) for _ in range(n)]
    target = solve([0.0] * n, c, b_total, cons)
    got = limit_moves(current, target, max_move, cons)
    assert sum(got) == b_total
    assert check_placement(got, b_total, cons) is None
    step = max_move // g * g
    assert all(abs(x - y) <= step for x, y in zip(got, current, strict=True)) or got == target
    # Never moves a rank the wrong way.
    assert all(min(cu, ta) <= x <= max(cu, ta) or got == target
               for x, cu, ta in zip(got, current, target, strict=True))

"""Peak-memory fit and memory caps: unit and property tests (backend.policy.memory)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.policy import (
    Constraints,
    MemoryFit,
    MemoryReading,
    NoProposal,
    PolicyConfig,
    Proposal,
    RankMemory,
    decide,
    fit_memory,
    memory_bounds,
    memory_cap,
    memory_violations,
    solve,
    with_caps,
)

from ._build import observe

GIB = 2**30


def _readings(m0: float, m: float, sizes: list[int], *, total: int | None = None,
              jitter: list[float] | None = None) -> list[MemoryReading]:
    out = []
    for k, b in enumerate(sizes):
        j = jitter[k % len(jitter)] if jitter else 0.0
        out.append(MemoryReading(b, int(m0 + m * b + j), total))
    return out


def test_two_sizes_recover_the_line():
    fit = fit_memory(_readings(2 * GIB, 50 * 2**20, [16, 16, 32, 32], total=80 * GIB))
    assert fit is not None and fit.method == "linear" and fit.sizes == 2
    assert fit.m0_bytes == pytest.approx(2 * GIB, rel=1e-9)
    assert fit.m_bytes == pytest.approx(50 * 2**20, rel=1e-9)
    assert (fit.total_bytes, fit.max_batch, fit.n) == (80 * GIB, 32, 4)


def test_one_size_is_proportional_and_over_predicts_larger_batches():
    fit = fit_memory(_readings(4 * GIB, 2**28, [32, 32, 32]))
    assert fit is not None and fit.method == "proportional" and fit.m0_bytes == 0.0
    assert fit.predict(32) == 4 * GIB + 2**28 * 32
    assert fit.predict(64) > 4 * GIB + 2**28 * 64  # safe: the fixed part is counted twice


def test_too_few_readings_and_dummy_steps_give_no_fit():
    assert fit_memory([MemoryReading(8, 1000)]) is None
    # A drained rank's one-sample dummy batch (local batch 0) is not a reading.
    assert fit_memory([MemoryReading(0, 1000), MemoryReading(0, 1000), MemoryReading(8, 1)]) is None


def test_warm_up_spike_and_dip_keep_the_fit_above_the_steady_peaks():
    # The first reading at a size is low (optimizer state not yet allocated) or high
    # (allocator growing): the envelope keeps the largest, so the steady state fits below.
    steady = _readings(GIB, 2**20, [10, 10, 10, 20, 20, 20])
    dip = [MemoryReading(10, GIB // 2)] + steady
    fit = fit_memory(dip)
    assert fit is not None
    assert all(fit.predict(r.local_batch_size) >= r.peak_bytes for r in steady)
    assert fit.m_bytes == pytest.approx(2**20)


def test_cap_is_the_largest_batch_under_the_limit():
    fit = MemoryFit(2 * GIB, GIB / 8, 16 * GIB, 4, 2, "linear", 6 * GIB, 32)
    cap = memory_cap(fit, None, 0.1)  # (14.4 - 2) * 8 = 99.2
    assert cap == 99
    assert fit.predict(cap) <= 0.9 * 16 * GIB < fit.predict(cap + 1)
    assert memory_cap(fit, None, 0.1, ceiling=50) == 50
    assert memory_cap(fit, 2 * GIB, 0.1) == 0  # the fixed part alone is over the limit
    no_total = MemoryFit(2 * GIB, GIB / 8, None, 4, 2, "linear", 6 * GIB, 32)
    assert memory_cap(no_total, None) is None


def test_bounds_per_kind_of_rank():
    fit = MemoryFit(0.0, GIB, 20 * GIB, 4, 2, "linear", 8 * GIB, 8)
    ranks = [RankMemory("cuda", fit, 20 * GIB),  # fit: cap 18
             RankMemory("cuda"),  # measures, no fit yet: may only lose
             RankMemory(""),  # CPU or an old hook: no cap
             RankMemory("cuda", fit, 20 * GIB, max_share=11)]  # ran out of memory at 12
    caps, why = memory_bounds(ranks, [10, 20, 30, 40], 100)
    assert caps == {0: 18, 1: 20, 3: 11}
    assert why == {0: "memory", 1: "memory_unknown", 3: "out_of_memory"}
    with pytest.raises(ValueError, match="memory has 4 ranks but shares has 3"):
        memory_bounds(ranks, [1, 2, 3], 6)


def test_violations_name_the_predicted_peak_and_the_cap():
    fit = MemoryFit(GIB, GIB / 4, 8 * GIB, 4, 2, "linear", 3 * GIB, 8)
    ranks = [RankMemory("cuda", fit, 8 * GIB), RankMemory("")]
    assert memory_violations(ranks, [20, 100]) == []
    got = memory_violations(ranks, [30, 90])
    assert got == ["rank 0 would peak at 8.5 GiB with 30 samples, above its limit of 7.2 GiB "
                   "(90% of 8.0 GiB); its memory cap is 24 samples"]
    oom = [RankMemory("cuda", None, 8 * GIB, max_share=9)]
    assert memory_violations(oom, [10]) == [
        "rank 0 ran out of memory at 10 samples and may hold at most 9, got 10"]


def test_fast_rank_with_little_memory_is_capped_and_the_reason_says_why():
    # Rank 0 is 3x faster but has 8 GiB; speed alone would give it 96 of 128.
    small = MemoryFit(2 * GIB, GIB / 16, 8 * GIB, 10, 2, "linear", 4 * GIB, 32)  # cap 83
    big = MemoryFit(2 * GIB, GIB / 16, 80 * GIB, 10, 2, "linear", 4 * GIB, 32)
    obs = observe([0.0] * 2, [1.0, 3.0], [64, 64], steps=30,
                  memory=[RankMemory("cuda", small, 8 * GIB), RankMemory("cuda", big, 80 * GIB)])
    assert solve([0.0, 0.0], [1.0, 3.0], 128) == (96, 32)
    got = decide(obs, PolicyConfig())
    assert isinstance(got, Proposal)
    assert got.shares == (83, 45)
    assert ("rank 0 is capped at 83 samples by memory (predicted peak 7.2 GiB of a 7.2 GiB "
            "limit; speed alone would give it 96)") in got.reason
    r0 = got.explanation.ranks[0]
    assert r0.mem_cap == 83 and r0.mem_peak_after_bytes <= r0.mem_limit_bytes
    assert got.explanation.evidence["memory_capped"][0]["speed_share"] == 96


def test_rank_without_a_fit_only_loses_work():
    obs = observe([0.0] * 3, [1.0, 3.0, 3.0], [40, 40, 40], steps=30,
                  memory=[RankMemory("cuda"), RankMemory("cuda"), RankMemory("cuda")])
    got = decide(obs, PolicyConfig())
    assert isinstance(got, NoProposal) and got.status == "balanced"  # nobody may gain
    assert got.explanation.evidence["memory_capped"][0] == {
        "rank": 0, "cap": 40, "speed_share": 72, "why": "memory_unknown"}
    # A slow rank without a fit may lose work to ranks that do not measure memory (CPU).
    obs = observe([0.0] * 3, [3.0, 1.0, 1.0], [40, 40, 40], steps=30,
                  memory=[RankMemory("cuda"), RankMemory(""), RankMemory("")])
    got = decide(obs, PolicyConfig())
    assert isinstance(got, Proposal) and got.shares == (17, 52, 51)


def test_memory_caps_that_cannot_hold_the_batch_are_infeasible_with_a_reason():
    fit = MemoryFit(0.0, GIB, 10 * GIB, 4, 2, "linear", 4 * GIB, 4)  # cap 9
    obs = observe([0.0] * 2, [1.0, 1.0], [8, 8], steps=30,
                  memory=[RankMemory("cuda", fit, 10 * GIB)] * 2)
    got = decide(obs, PolicyConfig(), Constraints(drains=frozenset({1})))
    assert isinstance(got, NoProposal) and got.status == "infeasible"
    assert got.detail.endswith("(memory caps: rank 0 <= 9, rank 1 <= 9)")


# --- properties ------------------------------------------------------------------------------

_fits = st.builds(
    lambda m0, m, total: (m0, m, total),
    st.integers(0, 8 * GIB), st.integers(1, 256 * 2**20), st.integers(8 * GIB, 96 * GIB))


@settings(max_examples=200, deadline=None)
@given(line=_fits, sizes=st.lists(st.integers(1, 512), min_size=2, max_size=12),
       noise=st.lists(st.integers(0, 2**24), min_size=1, max_size=5),
       headroom=st.floats(0.0, 0.5))
def test_fit_never_under_predicts_a_reading_and_the_cap_fits(line, sizes, noise, headroom):
    m0, m, total = line
    readings = _readings(m0, m, sizes, total=total, jitter=[float(x) for x in noise])
    fit = fit_memory(readings)
    assert fit is not None
    for r in readings:
        assert fit.predict(r.local_batch_size) >= r.peak_bytes - 1e-6 * r.peak_bytes
    cap = memory_cap(fit, None, headroom)
    if cap is not None:
        limit = (1 - headroom) * total
        assert cap == 0 or fit.predict(cap) <= limit
        assert fit.predict(cap + 1) > limit
    if len(set(sizes)) == 1:  # one size: never under-predicts a larger batch
        b = sizes[0]
        assert fit.predict(2 * b) >= m0 + m * 2 * b - 1


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_solver_under_memory_caps_never_exceeds_them(data):
    n = data.draw(st.integers(1, 8))
    caps = data.draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))
    c = data.draw(st.lists(st.floats(0.1, 10.0), min_size=n, max_size=n))
    b_total = data.draw(st.integers(1, 200))
    cons = with_caps(Constraints(), dict(enumerate(caps)))
    if sum(caps) < b_total:
        with pytest.raises(ValueError, match="caps sum to"):
            solve([0.0] * n, c, b_total, cons)
        return
    shares = solve([0.0] * n, c, b_total, cons)
    assert sum(shares) == b_total
    assert all(s <= cap for s, cap in zip(shares, caps, strict=True))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_decide_never_proposes_a_peak_above_the_limit(data):
    n = data.draw(st.integers(2, 6))
    per = data.draw(st.lists(st.integers(2**20, 2**28), min_size=n, max_size=n))
    totals = data.draw(st.lists(st.integers(GIB, 16 * GIB), min_size=n, max_size=n))
    c = data.draw(st.lists(st.floats(0.5, 5.0), min_size=n, max_size=n))
    shares = [16] * n
    mem = [RankMemory("cuda", MemoryFit(0.0, float(p), t, 8, 2, "linear", p * 16, 16), t)
           for p, t in zip(per, totals, strict=True)]
    obs = observe([0.0] * n, c, shares, steps=30, memory=mem)
    got = decide(obs, PolicyConfig(min_gain=0.0))
    if isinstance(got, Proposal):
        for i, s in enumerate(got.shares):
            assert mem[i].fit is not None
            assert s <= shares[i] or mem[i].fit.predict(s) <= 0.9 * totals[i]
            assert got.explanation.ranks[i].mem_peak_after_bytes == mem[i].fit.predict(s)
    else:
        assert got.status in ("balanced", "insufficient_gain", "infeasible")

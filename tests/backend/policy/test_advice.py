"""Cost-aware advice: the predicted effect of dropping each rank, from the policy's solver."""

from __future__ import annotations

import pytest

from backend.policy.advice import drop_effects


def test_a_slow_expensive_rank_is_worth_releasing_and_fast_ones_are_kept():
    # Three equal ranks and a fourth four times slower at the same price.
    step, drops = drop_effects([0, 0, 0, 0], [1.0, 1.0, 1.0, 4.0], 130, [2.0, 2.0, 2.0, 2.0])
    assert step == pytest.approx(40.0)  # 40, 40, 40, 10 samples: 40 ms each
    slow = drops[3]
    assert slow.shares_without == (44, 43, 43, 0)
    assert slow.step_ms_without == pytest.approx(44.0)
    assert slow.throughput_gain == pytest.approx(44 / 40 - 1)  # it adds 10% throughput
    assert slow.cost_share == pytest.approx(0.25)  # for a quarter of the cost
    assert slow.cost_per_sample_change == pytest.approx(6 * 44 / (8 * 40) - 1)
    assert slow.advice == "rank 3 adds 10% throughput for 25% of the cost: release it (cost per sample -18%)"
    assert all(d.advice.endswith("keep it") for d in drops[:3])


def test_overhead_no_split_changes_dilutes_a_ranks_contribution():
    _, bare = drop_effects([0, 0], [1.0, 1.0], 100, [1.0, 1.0])
    _, padded = drop_effects([0, 0], [1.0, 1.0], 100, [1.0, 1.0], overhead_ms=100.0)
    assert bare[1].throughput_gain == pytest.approx(1.0)  # 100 ms alone against 50 ms
    assert padded[1].throughput_gain == pytest.approx(200 / 150 - 1)


def test_unknown_prices_and_single_rank_say_so():
    _, drops = drop_effects([0, 0], [1.0, 2.0], 30, [None, 1.0])
    assert drops[0].cost_share is None
    assert drops[0].advice == "rank 0 adds 200% throughput (no price known for the job)"
    _, alone = drop_effects([0], [1.0], 8, [1.0])
    assert alone[0].advice == "rank 0 is the only rank: keep it"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="one value per rank, got 2, 2 and 1"):
        drop_effects([0, 0], [1, 1], 8, [1.0])
    with pytest.raises(ValueError, match="overhead_ms must be a finite number >= 0, got -1"):
        drop_effects([0], [1], 8, [1.0], overhead_ms=-1)

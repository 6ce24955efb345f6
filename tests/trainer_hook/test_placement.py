"""PlacementSchedule: batch index -> placement, settled horizon, validation."""

from __future__ import annotations

import pytest

from trainer_hook.placement import PlacementSchedule


def test_starts_uniform_at_version_0() -> None:
    s = PlacementSchedule(3, 10)
    p = s.at(0)
    assert (p.version, p.shares, p.start_batch) == (0, (4, 3, 3), 0)
    assert p.offsets(0) == (0, 4) and p.offsets(2) == (7, 10)


def test_placements_are_tied_to_batch_indices() -> None:
    s = PlacementSchedule(2, 8)
    s.add(5, 1, [2, 6])
    s.add(9, 3, [8, 0])
    assert [s.at(k).version for k in (0, 4, 5, 8, 9, 100)] == [0, 0, 1, 1, 3, 3]
    assert s.latest.version == 3
    assert [t.start_batch for t in s.timeline()] == [0, 5, 9]


@pytest.mark.parametrize(
    ("start", "version", "shares", "match"),
    [
        (6, 1, [4, 4], "not newer than version 2"),
        (4, 3, [4, 4], "before version 2 at batch 5"),
        (6, 3, [4, 5], "sum to 9"),
        (6, 3, [4, 4, 0], "world_size 2"),
        (6, 3, [9, -1], r"shares\[1\] must be >= 0"),
    ],
)
def test_add_refuses_invalid(start: int, version: int, shares: list, match: str) -> None:
    s = PlacementSchedule(2, 8)
    s.add(5, 2, [3, 5])
    with pytest.raises(ValueError, match=match):
        s.add(start, version, shares)
    assert s.latest.version == 2


def test_asking_past_the_settled_horizon_is_a_clear_error() -> None:
    s = PlacementSchedule(2, 8, settled_until=4)
    assert s.at(4).version == 0
    with pytest.raises(RuntimeError, match=r"batch 5 is not settled yet \(settled up to batch 4\).*lookahead"):
        s.at(5)
    s.settle(9)
    s.settle(7)  # never moves back
    assert s.settled_until == 9


def test_replace_initial_resumes_a_placement() -> None:
    s = PlacementSchedule(2, 8)
    s.replace_initial(7, [6, 2])
    assert s.at(0).version == 7 and s.at(0).shares == (6, 2)
    with pytest.raises(ValueError, match="not newer"):
        s.add(3, 7, [4, 4])

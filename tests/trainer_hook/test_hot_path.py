"""The step's fast paths give the same answers as the slow ones they skip."""

from __future__ import annotations

import bisect

import pytest

from trainer_hook.channel import ControlChannel, PendingPlacement
from trainer_hook.gradients import GradientState
from trainer_hook.placement import PlacementSchedule


def _slow_at(s: PlacementSchedule, k: int) -> tuple[int, tuple[int, ...]]:
    entries = s.timeline()
    e = entries[bisect.bisect_right([t.start_batch for t in entries], k) - 1]
    return e.version, e.shares


def test_schedule_hint_never_outlives_a_change() -> None:
    s = PlacementSchedule(2, 8, settled_until=None)
    assert s.at(3).version == 0  # caches a hint covering batch 3 onwards
    s.add(5, 1, [2, 6])  # allowed: nothing settled
    s.add(5, 2, [6, 2])  # replaces the entry at the same start
    for k in range(12):
        p = s.at(k)
        assert (p.version, p.shares) == _slow_at(s, k)
    s.replace_initial(7, [1, 7])
    assert [s.at(k).version for k in (0, 9)] == [7, 7]


def test_schedule_hint_respects_the_settled_horizon() -> None:
    s = PlacementSchedule(2, 8, settled_until=4)
    assert s.at(4).version == 0
    with pytest.raises(RuntimeError, match="not settled yet"):
        s.at(5)
    s.settle(9)
    assert s.at(9).version == 0
    s.add(10, 1, [2, 6])
    s.settle(12)
    assert [s.at(k).version for k in (9, 10, 12)] == [0, 1, 1]
    with pytest.raises(RuntimeError, match="not settled yet"):
        s.at(13)


class _Spy(ControlChannel):
    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.calls: list[tuple[str, int]] = []

    def _launch(self, step: int) -> None:
        self.calls.append(("launch", step))
        super()._launch(step)

    def _collect(self) -> None:
        assert self._inflight is not None
        self.calls.append(("collect", self._inflight[0]))
        super()._collect()


@pytest.mark.parametrize(("every", "lag"), [(1, 0), (4, 0), (4, 1), (8, 2), (8, 7)])
def test_on_step_skips_only_steps_with_nothing_to_do(every: int, lag: int) -> None:
    s = PlacementSchedule(2, 8)
    ch = _Spy(rank=0, world_size=2, schedule=s, exchange_every=every, exchange_lag=lag, lookahead=3)
    ch.offer(PendingPlacement(1, (2, 6)))
    expected: list[tuple[str, int]] = []
    inflight: int | None = None
    for k in [*range(40), 39]:  # the last one repeats a batch (a step that raised)
        if inflight is not None and k >= inflight + lag:
            expected.append(("collect", inflight))
            inflight = None
        if k % every == 0 and inflight is None:
            expected.append(("launch", k))
            inflight = k
        ch.on_step(k)
    assert ch.calls == expected
    assert s.latest.version == 1


def test_gradient_state_reset_clears_the_buckets_seen() -> None:
    g = GradientState()
    g.buckets_seen |= 1 << 3
    g.repeated_bucket = True
    g.reset()
    assert g.buckets_seen == 0 and not g.repeated_bucket and g.last_bucket_t is None


def test_the_exchange_carries_the_placements_cost_model() -> None:
    s = PlacementSchedule(2, 8)
    ch = ControlChannel(rank=0, world_size=2, schedule=s, exchange_every=2, exchange_lag=1, lookahead=2)
    ch.offer(PendingPlacement(1, (2, 6), "fit", 3.25e-4))
    for k in range(8):
        ch.on_step(k)
    assert (s.latest.version, s.latest.shares, s.latest.length_sq_weight) == (1, (2, 6), 3.25e-4)
    assert ch.sync_initial(4, [5, 3], 1e-3) == (4, [5, 3])
    assert s.at(0).length_sq_weight == 1e-3

"""LiveState.communication at scale: the assessment goes over every rank's window (216 ms
at 4,096 ranks on this machine) and the dashboard asked for it on every tick, a third of a
loaded backend's CPU (py-spy, bench.capacity at 4,096 ranks). An answer is reused while it
is younger than ten times what it cost, so the assessment takes at most a tenth of a core;
a small job's costs next to nothing and is recomputed whenever a step arrived."""

from __future__ import annotations

from backend.live.state import LiveState
from rebalancer_wire.protocol import Hello, Metrics, StepRecord


class StepClock:
    """Advances ``tick`` seconds on every reading: what a computation between two readings costs."""

    def __init__(self, tick: float) -> None:
        self.t, self.tick = 100.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


def _live(clock: StepClock, ranks: int = 4) -> LiveState:
    live = LiveState(clock=clock)
    for r in range(ranks):
        live.register(Hello(job="j", rank=r, world_size=ranks, global_batch_size=8 * ranks))
    for k in range(5):
        _step(live, k, ranks)
    return live


def _step(live: LiveState, k: int, ranks: int, sync_ms: float = 3.0) -> None:
    for r in range(ranks):
        live.add_metrics(Metrics(job="j", rank=r, device=[], steps=[StepRecord(
            batch_index=k, local_batch_size=8, placement_version=0, data_wait_ms=0.1, compute_ms=20.0,
            sync_wait_ms=sync_ms, optimizer_ms=0.5, step_ms=24.0, t=1.7e9 + k, comm_bytes=1000, comm_ms=sync_ms)]))


def test_an_assessment_is_reused_while_younger_than_ten_times_its_cost():
    clock = StepClock(0.05)  # each assessment "costs" 50 ms
    live = _live(clock)
    first = live.communication("j")
    assert first is not None and first.n_steps == 5
    _step(live, 5, 4, sync_ms=9.0)
    assert live.communication("j") is first  # 50 ms old, under 10 x 50 ms: the same answer
    clock.t += 1.0  # now older than that
    fresh = live.communication("j")
    assert fresh is not first and fresh.n_steps == 6 and fresh.exposed_comm_ms > first.exposed_comm_ms


def test_a_cheap_assessment_follows_every_step():
    clock = StepClock(0.0)  # costs nothing measurable
    live = _live(clock)
    first = live.communication("j")
    assert live.communication("j") is first  # nothing new: cached
    _step(live, 5, 4, sync_ms=9.0)
    fresh = live.communication("j")
    assert fresh is not first and fresh.n_steps == 6

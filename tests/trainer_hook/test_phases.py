"""The step's phases (trainer_hook.phases): GC pauses, loader and checkpoint time, with a
frozen clock; their checks at the wire's edge."""

from __future__ import annotations

import gc
import json

import pytest

from rebalancer_wire.protocol import Metrics, ProtocolError, StepRecord, decode, encode
from trainer_hook.gradients import GradientState
from trainer_hook.phases import PhaseClock, TimedIterator
from trainer_hook.timing import StepTimer


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class TickingClock(Clock):
    """A frozen clock that moves 1 us at every reading (so every timed span is positive)."""

    def __call__(self) -> float:
        self.t += 1e-6
        return self.t


def test_gc_pauses_add_up_per_generation_and_reset_each_step() -> None:
    clock = Clock()
    phases = PhaseClock(clock=clock)
    for gen, ms in ((0, 1.0), (0, 0.5), (2, 20.0)):
        phases._on_gc("start", {"generation": gen})
        clock.t += ms / 1e3
        phases._on_gc("stop", {"generation": gen})
    host, ckpt, gc_ms = phases.take(0.0, 1.0)
    assert host is None and ckpt is None  # no hook loader, no checkpoint
    assert gc_ms == pytest.approx((1.5, 0.0, 20.0))
    assert phases.take(0.0, 1.0) == (None, None, None)


def test_pauses_are_clipped_to_the_step() -> None:
    clock = Clock()
    phases = PhaseClock(clock=clock)
    phases._on_gc("start", {"generation": 2})
    clock.t += 0.5  # a collection before the first step, longer than it
    phases._on_gc("stop", {"generation": 2})
    _, _, gc_ms = phases.take(0.0, 0.1)
    assert gc_ms is not None and sum(gc_ms) == pytest.approx(100.0)


def test_loader_and_checkpoint_split_the_wait_before_the_step() -> None:
    clock = Clock()
    phases = PhaseClock(clock=clock)

    def batches():
        for i in range(3):
            clock.t += 0.030  # the loader's 30 ms
            yield i

    it = TimedIterator(batches(), phases)
    assert next(it) == 0
    phases.add_checkpoint(0.050)
    host, ckpt, gc_ms = phases.take(0.100, 0.300)  # a 100 ms gap: 30 loader, 50 checkpoint, 20 host
    assert (host, ckpt, gc_ms) == (pytest.approx(20.0), pytest.approx(50.0), None)
    host, ckpt, _ = phases.take(0.010, 0.2)  # nothing from the loader this time: all host
    assert host == pytest.approx(10.0) and ckpt is None


def test_collector_callbacks_are_installed_and_removed() -> None:
    phases = PhaseClock()
    phases.install()
    phases.install()
    try:
        assert gc.callbacks.count(phases._on_gc) == 1
        gc.collect()
        _, _, gc_ms = phases.take(0.0, 10.0)
        assert gc_ms is not None and gc_ms[2] > 0.0  # a full collection is generation 2
    finally:
        phases.uninstall()
    assert phases._on_gc not in gc.callbacks


def test_step_timer_carries_the_phases_on_its_record() -> None:
    clock = Clock(1.0)
    phases = PhaseClock(clock=clock)
    timer = StepTimer(clock=clock, wall=lambda: 1.7e9, phases=phases)
    timer.start(0, 8, 0)
    clock.t += 0.050
    timer.finish(GradientState())
    TimedIterator(iter([1]), phases).__next__()  # the loader: 0 ms
    clock.t += 0.020  # 20 ms of host work before the next step
    timer.start(1, 8, 0)
    phases._on_gc("start", {"generation": 1})
    clock.t += 0.004
    phases._on_gc("stop", {"generation": 1})
    clock.t += 0.046
    rec = timer.finish(GradientState())
    assert rec is not None
    assert rec.data_wait_ms == pytest.approx(20.0) and rec.step_ms == pytest.approx(70.0)
    assert rec.host_ms == pytest.approx(20.0) and rec.ckpt_ms is None
    assert rec.gc_ms == pytest.approx((0.0, 4.0, 0.0))
    back = decode(encode(Metrics(job="j", rank=0, steps=[rec])))
    assert isinstance(back, Metrics) and back.steps[0] == rec


def _frame(**extra: object) -> str:
    step = {"batch_index": 1, "local_batch_size": 4, "placement_version": 0, "data_wait_ms": 10.0,
            "compute_ms": 50.0, "sync_wait_ms": 5.0, "optimizer_ms": 5.0, "step_ms": 70.0, "t": 1.7e9, **extra}
    return json.dumps({"type": "metrics", "v": 2, "job": "j", "rank": 0, "steps": [step]})


def test_an_older_hook_without_phases_decodes_as_before() -> None:
    msg = decode(_frame())
    assert isinstance(msg, Metrics)
    s = msg.steps[0]
    assert (s.host_ms, s.ckpt_ms, s.gc_ms) == (None, None, None)
    assert "host_ms" not in s.to_dict() and "gc_ms" not in s.to_dict()


@pytest.mark.parametrize(("extra", "message"), [
    ({"host_ms": 8.0, "ckpt_ms": 3.0},
     "'host_ms' + 'ckpt_ms' (11) must not exceed 'data_wait_ms' (10): they are parts of the wait before the step."),
    ({"gc_ms": [10.0, 0.0, 61.0]},
     "'gc_ms' sums to 71 ms, more than the step's 'step_ms' (70): the pauses are parts of the step."),
    ({"gc_ms": [1.0, 2.0]},
     "'gc_ms' must be a list of 3 numbers (ms of garbage collection in generations 0, 1 and 2), "
     "each between 0 and 86400000, got [1.0, 2.0]."),
    ({"gc_ms": [1.0, -2.0, 0.0]},
     "'gc_ms' must be a list of 3 numbers (ms of garbage collection in generations 0, 1 and 2), "
     "each between 0 and 86400000, got [1.0, -2.0, 0.0]."),
    ({"host_ms": -1.0}, "'host_ms' must be a number between 0 and 86400000, got -1.0."),
    ({"ckpt_ms": "5"}, "'ckpt_ms' must be a number, got str."),
])
def test_phases_that_do_not_add_up_are_refused_at_the_edge(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ProtocolError) as err:
        decode(_frame(**extra))
    assert str(err.value) == message


def test_phases_within_their_wholes_pass() -> None:
    msg = decode(_frame(host_ms=4.0, ckpt_ms=6.0, gc_ms=[1.0, 0.0, 69.0], comm_bytes=100, comm_ms=3.0))
    assert isinstance(msg, Metrics)
    s = msg.steps[0]
    assert (s.host_ms, s.ckpt_ms, s.gc_ms, s.comm_bytes) == (4.0, 6.0, (1.0, 0.0, 69.0), 100)
    assert isinstance(s, StepRecord)


def test_a_hook_reports_its_loader_checkpoints_and_collections(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torch.utils.data import TensorDataset

    from trainer_hook import RebalanceHook

    for var in ("REBALANCER_SERVER", "REBALANCER_JOB", "REBALANCER_TOKEN", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    hook = RebalanceHook(global_batch_size=4)
    clock = TickingClock(50.0)
    hook._phases._clock = clock  # the phases' clock; the step timer keeps its own
    model = hook.attach(torch.nn.Linear(2, 1))
    ds = TensorDataset(torch.zeros(16, 2))
    loader = hook.data_loader(ds, shuffle=False)
    for (x,) in loader:
        with hook.step():
            model(x).sum().backward()
        if hook.batch_index == 2:
            with hook.checkpointing():
                clock.t += 0.002  # a 2 ms write between steps 1 and 2
                gc.collect()  # a full collection in the gap
    hook.close()
    assert hook._phases._on_gc not in gc.callbacks  # closed: the collector's callback left
    recs = list(hook.history)
    assert len(recs) == 4 and all(r.host_ms is not None for r in recs)  # the loader is the hook's
    ckpt = [r.ckpt_ms for r in recs]
    assert ckpt[:2] == [None, None] and ckpt[3] is None
    assert ckpt[2] == pytest.approx(min(2.0, recs[2].data_wait_ms), abs=0.01)  # within its wait, never beyond
    assert recs[2].gc_ms is not None and recs[2].gc_ms[2] > 0.0


class FakeGc:
    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.threshold = (700, 10, 10)

    def collect(self, gen: int = 2) -> int:
        self.calls.append(("collect", gen))
        return 0

    def freeze(self) -> None:
        self.calls.append(("freeze",))

    def unfreeze(self) -> None:
        self.calls.append(("unfreeze",))

    def get_threshold(self) -> tuple[int, int, int]:
        return self.threshold

    def set_threshold(self, *t: int) -> None:
        self.calls.append(("set_threshold", *t))
        self.threshold = t  # type: ignore[assignment]


def test_gc_schedule_freezes_once_and_collects_on_the_same_batches_everywhere() -> None:
    from trainer_hook.phases import GcSchedule

    fake = FakeGc()
    sched = GcSchedule(freeze=True, every=3, gc_module=fake)
    for k in range(5, 12):  # a resumed run: its first step is batch 5
        sched.on_step(k)
    assert fake.calls == [("collect", 2), ("freeze",), ("set_threshold", 700, 10, 1 << 30),
                          ("collect", 2), ("collect", 2)]  # batches 6 and 9: multiples of 3
    sched.restore()
    assert fake.calls[-2:] == [("set_threshold", 700, 10, 10), ("unfreeze",)]
    assert not GcSchedule(freeze=False, every=0, gc_module=fake).active


@pytest.mark.parametrize(("key", "value", "message"), [
    ("gc_freeze", 1, "gc_freeze must be True or False, got 1."),
    ("gc_collect_every", -1, "gc_collect_every must be an integer >= 0, got -1."),
    ("gc_collect_every", 2.5, "gc_collect_every must be an integer >= 0, got 2.5."),
])
def test_gc_settings_are_checked(key: str, value: object, message: str) -> None:
    from trainer_hook.config import HookConfig

    with pytest.raises(ValueError) as err:
        HookConfig(global_batch_size=4, **{key: value})  # type: ignore[arg-type]
    assert str(err.value) == message


def test_a_hook_collecting_every_two_steps_restores_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torch.utils.data import TensorDataset

    from trainer_hook import RebalanceHook

    for var in ("REBALANCER_SERVER", "REBALANCER_JOB", "REBALANCER_TOKEN", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    before = gc.get_threshold()
    hook = RebalanceHook(global_batch_size=4, gc_freeze=True, gc_collect_every=2)
    model = hook.attach(torch.nn.Linear(2, 1))
    during = []
    for (x,) in hook.data_loader(TensorDataset(torch.zeros(24, 2)), shuffle=False):
        with hook.step():
            model(x).sum().backward()
        during.append((gc.get_threshold()[2], gc.get_freeze_count() > 0))
    hook.close()
    assert all(t == 1 << 30 and frozen for t, frozen in during)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    full = [r.batch_index for r in hook.history if r.gc_ms is not None and r.gc_ms[2] > 0]
    assert full == [0, 2, 4]  # the first step's collection before the freeze, then every second

"""StepTimer and split_step with a frozen clock (no sleeps)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from trainer_hook.gradients import GradientState
from trainer_hook.timing import StepTimer, split_step


def test_split_step_separates_compute_sync_and_optimizer() -> None:
    assert split_step(10.0, 10.1, 10.04, 10.07) == pytest.approx((0.04, 0.03, 0.03))
    assert split_step(10.0, 10.1, None, None) == pytest.approx((0.1, 0.0, 0.0))
    assert split_step(10.0, 10.1, 10.04, None) == pytest.approx((0.04, 0.0, 0.06))
    # A completion stamped after the step ended (clock skew between threads) is clipped.
    assert split_step(10.0, 10.1, 10.04, 10.2) == pytest.approx((0.04, 0.06, 0.0))
    # Waits for peers before the gradients were ready (FSDP's all-gathers) are sync wait.
    assert split_step(10.0, 10.1, 10.04, 10.07, wait=0.03) == pytest.approx((0.01, 0.06, 0.03))
    assert split_step(10.0, 10.1, None, None, wait=0.02) == pytest.approx((0.08, 0.02, 0.0))
    assert split_step(10.0, 10.1, 10.04, 10.07, wait=0.5) == pytest.approx((0.0, 0.07, 0.03))  # at most compute


class FrozenClock:
    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def __call__(self) -> float:
        return self.values.pop(0)


def test_step_timer_records_data_wait_and_step_time() -> None:
    clock = FrozenClock(1.000, 1.050, 1.060, 1.100)
    timer = StepTimer(clock=clock, wall=lambda: 1700000000.0)
    grads = GradientState()
    timer.start(0, 8, 0)
    grads.last_bucket_t, grads.last_done_t = 1.030, 1.045
    r0 = timer.finish(grads)
    assert r0 is not None
    assert (r0.batch_index, r0.local_batch_size, r0.placement_version) == (0, 8, 0)
    assert r0.data_wait_ms == 0.0
    assert r0.compute_ms == pytest.approx(30.0)
    assert r0.sync_wait_ms == pytest.approx(15.0)
    assert r0.optimizer_ms == pytest.approx(5.0)
    assert r0.step_ms == pytest.approx(50.0)
    assert r0.t == 1700000000.0
    grads.reset()
    timer.start(1, 4, 2)
    r1 = timer.finish(grads)
    assert r1 is not None
    assert r1.data_wait_ms == pytest.approx(10.0)
    assert r1.compute_ms == pytest.approx(40.0)  # no gradient timestamps: all compute
    assert r1.step_ms == pytest.approx(50.0)  # data wait + step body
    assert clock.values == []


def test_waits_for_peers_before_the_gradients_move_from_compute_to_sync() -> None:
    # FSDP: the fast rank waited 20 ms inside a forward all-gather and 5 ms inside a
    # blocking reduce-scatter that was not the step's last.
    timer = StepTimer(clock=FrozenClock(1.000, 1.100), wall=lambda: 0.0)
    grads = GradientState()
    timer.start(0, 8, 0)
    grads.last_bucket_t, grads.last_done_t, grads.wait_s = 1.060, 1.070, 0.025
    rec = timer.finish(grads)
    assert rec is not None
    assert (rec.compute_ms, rec.sync_wait_ms, rec.optimizer_ms) == pytest.approx((35.0, 35.0, 30.0))
    grads.reset()
    assert grads.wait_s == 0.0 and grads.wait_events is None


def test_gradient_state_sums_the_host_time_between_begin_and_end_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer_hook import gradients

    monkeypatch.setattr(gradients, "_now", FrozenClock(2.0, 2.5, 3.0, 3.25))
    grads = GradientState()
    grads.end_wait(None)  # no wait begun: nothing
    grads.begin_wait(None)
    grads.end_wait(None)
    grads.begin_wait(None)
    grads.end_wait(None)
    assert grads.wait_s == pytest.approx(0.75)


class FakeEvent:
    """Stands in for torch.cuda.Event (no GPU here): a device time and a done flag."""

    log: list[str] = []

    def __init__(self, at: float, done: bool = True) -> None:
        self.at, self.done = at, done

    @staticmethod
    def handing_out(events: list[FakeEvent]) -> Callable[..., FakeEvent]:
        """An event class for StepTimer.start(events=...) that hands out ``events`` in order."""
        it = iter(events)
        return lambda enable_timing: next(it)

    def record(self) -> None:
        FakeEvent.log.append("record")

    def query(self) -> bool:
        FakeEvent.log.append("query")
        return self.done

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.at - self.at) * 1e3

    def synchronize(self) -> None:  # pragma: no cover - must never be called
        raise AssertionError("the timer must not synchronise the device")


def test_cuda_path_reads_events_a_step_later_without_synchronising() -> None:
    # Device times (s) handed out in order: start of step 0, end of step 0, start of step 1, ...
    events = FakeEvent.handing_out([FakeEvent(0.0), FakeEvent(0.050, done=False), FakeEvent(0.060), FakeEvent(0.110)])
    timer = StepTimer(clock=FrozenClock(1.0, 1.01, 1.02, 1.03), wall=lambda: 5.0)
    grads = GradientState()
    timer.start(0, 8, 0, events=events)
    grads.grad_event, grads.done_event = FakeEvent(0.020), FakeEvent(0.045)
    assert timer.finish(grads) is None  # step 0's end event has not completed yet
    end0 = timer._pending_events[0][3]
    end0.done = True
    grads.reset()
    timer.start(1, 8, 0, events=events)
    grads.grad_event, grads.done_event = FakeEvent(0.080), FakeEvent(0.100)
    rec = timer.finish(grads)
    assert rec is not None and rec.batch_index == 0
    assert rec.compute_ms == pytest.approx(20.0)
    assert rec.sync_wait_ms == pytest.approx(25.0)
    assert rec.optimizer_ms == pytest.approx(5.0)
    assert rec.step_ms == pytest.approx(50.0)
    rec1 = timer._read_events()
    assert rec1 is not None and rec1.batch_index == 1 and rec1.compute_ms == pytest.approx(20.0)


def test_cuda_path_moves_the_event_timed_waits_from_compute_to_sync() -> None:
    events = FakeEvent.handing_out([FakeEvent(0.0), FakeEvent(0.050)])
    timer = StepTimer(clock=FrozenClock(1.0, 1.05), wall=lambda: 5.0)
    grads = GradientState()
    timer.start(0, 8, 0, events=events)
    grads.grad_event, grads.done_event = FakeEvent(0.030), FakeEvent(0.040)
    grads.wait_events = [(FakeEvent(0.002), FakeEvent(0.012)), (FakeEvent(0.015), FakeEvent(0.020))]
    rec = timer.finish(grads)
    assert rec is not None
    assert (rec.compute_ms, rec.sync_wait_ms, rec.optimizer_ms) == pytest.approx((15.0, 25.0, 10.0))


def test_timing_event_names_the_event_class_of_each_accelerator_and_none_for_the_host() -> None:
    from trainer_hook.gradients import timing_event

    assert timing_event("cuda") is torch.cuda.Event
    assert timing_event("xpu") is torch.xpu.Event
    assert timing_event("mps") is torch.mps.event.Event
    assert timing_event("cpu") is None and timing_event("meta") is None


class DeviceClockEvent:
    """Stands in for torch.xpu.Event / torch.mps.event.Event (no such device here): record()
    stamps the next time of a fake device clock, elapsed_time() is in milliseconds."""

    device_times: list[float] = []
    made = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "a timing event must be made with enable_timing=True"
        DeviceClockEvent.made += 1
        self.at: float | None = None

    def record(self) -> None:
        self.at = DeviceClockEvent.device_times.pop(0)

    def query(self) -> bool:
        return self.at is not None

    def elapsed_time(self, end: DeviceClockEvent) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1e3

    def synchronize(self) -> None:  # pragma: no cover - must never be called
        raise AssertionError("the timer must not synchronise the device")


def _one_step(timer: StepTimer, grads: GradientState, k: int, tensor: Any) -> Any:
    """What the hook and its gradient paths call in one step: an FSDP-style wait for peers
    before the gradients, the last gradient ready, its reduction complete."""
    from trainer_hook.gradients import _mark_ready, _mark_reduced, _tensor_event

    grads.reset()
    timer.start(k, 8, 0, events=grads.events)
    waits = _tensor_event(tensor)  # what register_unshard_timer passes for this device
    grads.begin_wait(waits)
    grads.end_wait(waits)
    _mark_ready(grads, tensor)
    _mark_reduced(grads, tensor)
    return timer.finish(grads)


@pytest.mark.parametrize("device", ["xpu", "mps"])
def test_an_xpu_or_mps_rank_is_timed_with_its_device_events(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    from trainer_hook import gradients

    if device == "xpu":
        monkeypatch.setattr(torch.xpu, "Event", DeviceClockEvent)
    else:
        monkeypatch.setattr(torch.mps.event, "Event", DeviceClockEvent)
    # Device times (s): step 0's four marks, then step 1 starts at 0, waits for a peer
    # 2..12 ms, its last gradient is ready at 30 ms, reduced at 45 ms, and ends at 50 ms.
    # The host clock says a second a step, and no mark may take a host timestamp.
    monkeypatch.setattr(gradients, "_now", lambda: pytest.fail("a host timestamp on an event-timed device"))
    DeviceClockEvent.device_times = [9.0, 9.1, 9.2, 9.3] + [0.0, 0.002, 0.012, 0.030, 0.045, 0.050]
    timer = StepTimer(clock=FrozenClock(1.0, 2.0, 2.0, 3.0), wall=lambda: 5.0)
    grads = GradientState()
    on_device = SimpleNamespace(is_cpu=False, device=torch.device(device))
    # Step 0 learns the device from its first gradient (as on CUDA): host time for the step.
    first = _one_step(timer, grads, 0, on_device)
    assert first is not None and first.compute_ms == pytest.approx(1000.0)
    assert grads.events is DeviceClockEvent
    rec = _one_step(timer, grads, 1, on_device)
    assert rec is not None and rec.batch_index == 1
    assert (rec.compute_ms, rec.sync_wait_ms, rec.optimizer_ms) == pytest.approx((20.0, 25.0, 5.0))
    assert DeviceClockEvent.device_times == []  # every mark of step 1 was a device event


def test_a_cpu_rank_keeps_host_timestamps(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer_hook import gradients

    # Accelerator event classes present but never made for a CPU tensor.
    monkeypatch.setattr(torch.xpu, "Event", DeviceClockEvent)
    monkeypatch.setattr(torch.mps.event, "Event", DeviceClockEvent)
    DeviceClockEvent.made = 0
    # Host marks: wait 1.002..1.012, gradient ready 1.030, reduced 1.045.
    monkeypatch.setattr(gradients, "_now", FrozenClock(1.002, 1.012, 1.030, 1.045))
    timer = StepTimer(clock=FrozenClock(1.0, 1.05), wall=lambda: 5.0)
    grads = GradientState()
    rec = _one_step(timer, grads, 0, torch.zeros(1))
    assert rec is not None and grads.events is None and DeviceClockEvent.made == 0
    assert (rec.compute_ms, rec.sync_wait_ms, rec.optimizer_ms) == pytest.approx((20.0, 25.0, 5.0))


def test_an_fsdp2_all_gather_on_the_host_counts_exactly_the_wait_timed_around_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI's sharded test saw an FSDP2 step's communication time past its sync wait on a loaded
    machine: the all-gather was timed with clock readings of its own, outside the wait's, so
    a thread switch between them (the sender's turn at the GIL) counted as communication but
    not as waiting. Both now come from the same readings: a gloo all-gather blocks, all inside
    the wait."""
    from trainer_hook import gradients

    class Result:
        all_gather_input_split_sizes = [4, 4]
        all_gather_output = torch.zeros(8, dtype=torch.float32)

    class Group:
        _all_gather_result = None

        def unshard(self) -> None:
            self._all_gather_result = Result()

    ticks = iter(range(100))  # every clock reading is 1 s after the one before
    monkeypatch.setattr(gradients, "_now", lambda: float(next(ticks)))
    grads = GradientState()
    group = Group()
    gradients._TimedMethod(group, "unshard", grads, None, all_gather=True)
    group.unshard()
    assert grads.comm_bytes == 32
    assert grads.wait_s > 0
    assert grads.comm_s == grads.wait_s
    group.unshard()  # already gathered (FSDP's prefetch did it): no bytes, no time of its own
    assert grads.comm_bytes == 32 and grads.comm_s == 1.0


class SteppedClock:
    """A frozen clock the test moves by hand (the timer and the wait timer both read it)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("count", [12, torch.tensor(12)], ids=["int", "tensor"])
def test_the_token_counts_all_reduce_is_sync_wait_not_compute(monkeypatch: pytest.MonkeyPatch, count: Any) -> None:
    # Issue 39: under the README's loop (count after the forward) a fast rank waits inside
    # token_loss_weight's all-reduce for the slow rank's forward; that wait is not compute.
    from trainer_hook import RebalanceHook, gradients
    from trainer_hook import _weights as weights_module

    clock = SteppedClock(10.0)
    monkeypatch.setattr(gradients, "_now", clock)
    hook = RebalanceHook(job="t", global_batch_size=4)
    hook._init_distributed("test")
    hook._timer._clock = clock
    hook._c.weighting._world_size = 2  # as if a peer took part: the fake collective below stands in for it
    calls: list[object] = []

    def all_reduce(t: torch.Tensor, op: Any = None, group: Any = None) -> None:
        calls.append(group)
        clock.now += 0.030  # waiting for the slow peer's forward
        t.mul_(2)

    monkeypatch.setattr(weights_module.dist, "all_reduce", all_reduce)
    with hook.step():
        clock.now += 0.010  # this rank's forward
        weight = hook.token_loss_weight(count)
        clock.now += 0.005  # its backward and optimizer step
    hook.close()
    assert len(calls) == 1 and float(weight) == pytest.approx(2 / 24)  # no attach: the wrapper averages over 2
    rec = hook.last_step
    assert rec is not None
    assert rec.compute_ms == pytest.approx(15.0)
    assert rec.sync_wait_ms == pytest.approx(30.0)
    assert rec.step_ms == pytest.approx(45.0)


def test_the_hooks_exchange_on_entry_is_sync_wait_not_data_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 39: the placement exchange collected on entry to hook.step() (and the lookahead's
    # agreement at the first step) waits for peers; it was counted as the loader's time.
    from trainer_hook import RebalanceHook, gradients

    clock = SteppedClock(10.0)
    monkeypatch.setattr(gradients, "_now", clock)
    hook = RebalanceHook(job="t", global_batch_size=4, lookahead=1)
    hook._init_distributed("test")
    hook._timer._clock = clock
    with hook.step():
        clock.now += 0.010
    clock.now += 0.005  # the loader's turn
    channel = hook._c.channel
    monkeypatch.setattr(channel, "due", 0)

    def on_step(k: int) -> None:
        clock.now += 0.020  # waiting for the broadcast launched steps ago

    monkeypatch.setattr(channel, "on_step", on_step)
    with hook.step():
        clock.now += 0.010
    hook.close()
    rec = hook.last_step
    assert rec is not None and rec.batch_index == 1
    assert rec.data_wait_ms == pytest.approx(5.0)
    assert rec.sync_wait_ms == pytest.approx(20.0)
    assert rec.compute_ms == pytest.approx(10.0)
    assert rec.step_ms == pytest.approx(35.0)


def test_the_entry_wait_is_clipped_to_the_gap_before_the_step() -> None:
    timer = StepTimer(clock=FrozenClock(1.000, 1.010, 1.050, 1.060), wall=lambda: 0.0)
    grads = GradientState()
    timer.start(0, 8, 0)
    assert timer.finish(grads) is not None
    timer.start(1, 8, 0, waited=0.5)  # more than the 40 ms gap: at most the gap
    rec = timer.finish(grads)
    assert rec is not None
    assert (rec.data_wait_ms, rec.sync_wait_ms, rec.compute_ms, rec.step_ms) == pytest.approx((0.0, 40.0, 10.0, 50.0))


def test_a_replicas_pace_check_after_a_step_is_the_next_steps_sync_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # A mesh replica's members wait at a hand-over for the last window to be combined
    # (trainer_hook.mesh.ReplicaPace): time in the hook, after the step's record was taken.
    from trainer_hook import RebalanceHook, gradients

    clock = SteppedClock(10.0)
    monkeypatch.setattr(gradients, "_now", clock)
    hook = RebalanceHook(job="t", global_batch_size=4, lookahead=1)
    hook._init_distributed("test")
    hook._timer._clock = clock

    class Pace:
        leader = False

        def add(self, rec: Any, fingerprint: int = 0, stage_ms: Any = None) -> tuple[()]:
            return ()

        def on_step_end(self, trained: int, late: bool) -> None:
            clock.now += 0.012

    hook._c.loop._pace = Pace()  # type: ignore[assignment]
    for _ in range(2):
        with hook.step():
            clock.now += 0.010
        clock.now += 0.003  # the loader
    hook._c.loop._pace = None
    hook.close()
    rec = hook.last_step
    assert rec is not None and rec.batch_index == 1
    assert (rec.data_wait_ms, rec.sync_wait_ms, rec.compute_ms) == pytest.approx((3.0, 12.0, 10.0))

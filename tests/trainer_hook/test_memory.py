"""trainer_hook.memory: the meter's windows and warm-up, the hook's memory fields, and
what an out-of-memory error inside hook.step() does."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.fake_memory import FakeDeviceMemory
from trainer_hook import RebalanceHook
from trainer_hook.memory import MemoryMeter, MemoryReading, default_memory_source, is_out_of_memory


@pytest.fixture(autouse=True)
def _offline_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("REBALANCER_SERVER", "REBALANCER_JOB", "REBALANCER_TOKEN", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def _fake() -> FakeDeviceMemory:
    return FakeDeviceMemory(total_bytes=10_000, fixed_bytes=1_000, bytes_per_sample=100)


def test_meter_drops_the_warm_up_then_reads_every_n_steps_at_one_size() -> None:
    mem = _fake()
    meter = MemoryMeter(mem, every=4, warmup=2)
    got = []
    for local in [8] * 2 + [8] * 8 + [4] * 6:
        meter.begin(local)
        mem.allocate(local)
        got.append(meter.end())
    readings = [r for r in got if r is not None]
    # Steps 0-1: warm-up, read and dropped; steps 2-5 and 6-9 at 8; then 4 from step 10.
    assert readings == [MemoryReading(8, 1_800, 1_400, 10_000)] * 2 + [MemoryReading(4, 1_400, 1_400, 10_000)]
    assert [i for i, r in enumerate(got) if r is not None] == [5, 9, 13]
    assert mem.reads == 4  # the warm-up read, and one per window: never per step


def test_meter_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="every must be an integer >= 1, got 0"):
        MemoryMeter(_fake(), every=0)


def test_cpu_has_no_source_and_oom_is_recognised() -> None:
    assert not torch.cuda.is_available()
    assert default_memory_source() is None
    assert is_out_of_memory(torch.OutOfMemoryError("x"))
    assert not is_out_of_memory(RuntimeError("x")) and not is_out_of_memory(None)


def _train(hook: RebalanceHook, mem: FakeDeviceMemory, steps: int) -> None:
    model = hook.attach(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        x = torch.randn(hook.shares[0], 4)
        with hook.step():
            mem.allocate(x.shape[0])
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()


def test_hook_records_carry_the_peak_every_memory_every_steps() -> None:
    mem = _fake()
    hook = RebalanceHook(global_batch_size=8, memory_source=mem, memory_every=4)
    _train(hook, mem, 14)
    hook.close()
    with_mem = [r for r in hook.history if r.mem_peak_bytes is not None]
    assert [r.batch_index for r in with_mem] == [5, 9, 13]
    assert {(r.local_batch_size, r.mem_peak_bytes, r.mem_total_bytes) for r in with_mem} == {(8, 1_800, 10_000)}
    assert hook._hello().memory_source == "cuda"


def test_hook_without_a_source_sends_no_memory() -> None:
    hook = RebalanceHook(global_batch_size=8, memory_source=None)
    _train(hook, _fake(), 10)
    hook.close()
    assert all(r.mem_peak_bytes is None for r in hook.history)
    assert hook._hello().memory_source == ""


def test_out_of_memory_propagates_and_the_step_is_not_counted() -> None:
    mem = FakeDeviceMemory(total_bytes=1_500, fixed_bytes=1_000, bytes_per_sample=100)
    hook = RebalanceHook(global_batch_size=8, memory_source=mem)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        _train(hook, mem, 3)
    assert hook.batch_index == 0 and not hook.history
    hook.close()

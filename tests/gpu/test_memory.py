"""Peak device memory (trainer_hook.memory) against torch.cuda's own counters."""

from __future__ import annotations

import pytest
import torch

from tests.gpu._rig import Rig, write_fact
from trainer_hook import RebalanceHook

MiB = 2**20


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("REBALANCER_SERVER", "REBALANCER_JOB", "REBALANCER_TOKEN", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_peak_reading_equals_max_memory_allocated(rig: Rig) -> None:
    mem = rig.memory()
    src = mem.source()
    assert src is not None and src.name == "cuda"
    src.reset()
    a = mem.alloc(64 * MiB)
    b = mem.alloc(128 * MiB)
    mem.free(b)
    del b
    expected_peak, expected_reserved = mem.max_memory_allocated(), mem.memory_reserved()
    assert expected_peak >= 192 * MiB
    peak, reserved = src.read_and_reset()
    assert (peak, reserved) == (expected_peak, expected_reserved)
    # Reset: the peak starts again from what is allocated now.
    assert mem.max_memory_allocated() == mem.memory_allocated() >= 64 * MiB
    mem.free(a)
    write_fact("memory_peak", {"peak_bytes": peak, "reserved_bytes": reserved})


def test_hook_records_carry_the_window_peak(rig: Rig) -> None:
    mem = rig.memory()
    per_sample = 4 * MiB
    hook = RebalanceHook(global_batch_size=8, memory_source=mem.source(), memory_every=4)
    model = hook.attach(torch.nn.Linear(4, 1).to(rig.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch_peaks = []
    for _ in range(14):
        with hook.step() as k:
            x = torch.randn(hook.shares[0], 4, device=rig.device)
            act = mem.alloc(per_sample * x.shape[0])  # the step's activations
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            mem.free(act)
            del act
        torch_peaks.append((k, mem.max_memory_allocated()))
    hook.close()
    with_mem = [r for r in hook.history if r.mem_peak_bytes is not None]
    assert [r.batch_index for r in with_mem] == [5, 9, 13]
    for r in with_mem:
        assert r.local_batch_size == 8 and r.mem_total_bytes == mem.source().total_bytes()
        assert r.mem_peak_bytes >= 8 * per_sample
        assert r.mem_peak_bytes <= max(p for _, p in torch_peaks)
    assert hook._hello().memory_source == "cuda"
    write_fact("memory_hook", {"peaks": [r.mem_peak_bytes for r in with_mem], "step_alloc_bytes": 8 * per_sample})

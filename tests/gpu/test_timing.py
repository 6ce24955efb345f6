"""CUDA-event step timing against known injected device delays, in one process (world size 1):
DDP's comm hook (the default path) and FSDP2 on ``gradients="loss_scale"``.

The forward keeps the device busy ``FORWARD_MS`` (compute), the optimizer section
``OPTIMIZER_MS``; the hook reads its events a step later and never synchronises, the test
synchronises once at each end of the timed run. Ratios within one run only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from tests.gpu._rig import Rig, write_fact
from trainer_hook import RebalanceHook

FORWARD_MS = 20.0
OPTIMIZER_MS = 10.0
STEPS = 30
WARMUP = 5


class Delayed(torch.nn.Module):
    def __init__(self, rig: Rig) -> None:
        super().__init__()
        self.rig = rig
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rig.busy(FORWARD_MS)
        return self.net(x)  # type: ignore[no-any-return]


@pytest.fixture
def one_rank(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("REBALANCER_SERVER", "REBALANCER_JOB", "REBALANCER_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    rig.use_host_events(monkeypatch)
    dist.init_process_group(rig.dist_backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=rig.device if rig.is_cuda else None)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _wrap(rig: Rig, model: torch.nn.Module, how: str) -> torch.nn.Module:
    model = model.to(rig.device)
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[0] if rig.is_cuda else None)
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.net)
    return fully_shard(model)  # type: ignore[no-any-return]


# Where the loop reads its loss (a CPU-GPU sync point, as a loop that logs every step):
# "inside" hook.step(), or "after" it. Without any sync point these few long kernels would
# let the host run dozens of steps ahead of the device, past the 8 steps of events the hook
# keeps pending (it then drops the oldest): a real model's thousands of kernels a step fill
# CUDA's launch queue long before that.
SUSPECTED_DOUBLE_COUNT = (
    "suspected, unverified on a GPU: with the sync after hook.step(), the host's wait for the "
    "device lands in the next step's data_wait while the device time is also in step_ms")


@pytest.mark.parametrize(("how", "gradients", "mechanism", "sync_point"), [
    ("ddp", "auto", "ddp_comm_hook", "inside"),
    ("fsdp2", "loss_scale", "loss_scale", "inside"),
    ("ddp", "auto", "ddp_comm_hook", "after"),
])
def test_event_timing_matches_the_injected_delays_and_the_wall_clock(
        rig: Rig, one_rank: None, how: str, gradients: str, mechanism: str, sync_point: str,
        request: pytest.FixtureRequest) -> None:
    if sync_point == "after" and rig.is_cuda:
        request.applymarker(pytest.mark.xfail(reason=SUSPECTED_DOUBLE_COUNT, strict=False))
    hook = RebalanceHook(global_batch_size=32, memory_source=None)
    model = hook.attach(_wrap(rig, Delayed(rig), how), gradients=gradients)
    assert hook.gradients == mechanism
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 64, generator=gen).to(rig.device), torch.randn(32, 1, generator=gen).to(rig.device)
    for k in range(STEPS):
        if k == WARMUP:
            rig.sync()
            t0 = time.perf_counter()
        with hook.step():
            loss = torch.nn.functional.mse_loss(model(x), y) * hook.loss_weight()
            loss.backward()
            rig.busy(OPTIMIZER_MS)
            opt.step()
            opt.zero_grad()
            if sync_point == "inside":
                loss.item()  # a CPU-GPU sync point
        if sync_point == "after":
            loss.item()  # a CPU-GPU sync point
    rig.sync()
    wall_s = time.perf_counter() - t0
    hook.close()
    events = hook._grads.events
    assert events is not None, "the hook took host timestamps: the event path did not run"
    recs = [r for r in hook.history if r.batch_index >= WARMUP]
    assert len(recs) >= STEPS - WARMUP - 2, [r.batch_index for r in hook.history]
    compute = statistics.median(r.compute_ms for r in recs)
    optimizer = statistics.median(r.optimizer_ms for r in recs)
    sync = statistics.median(r.sync_wait_ms for r in recs)
    per_step_wall_ms = wall_s * 1e3 / (STEPS - WARMUP)
    per_step_hook_ms = statistics.mean(r.step_ms for r in recs)
    write_fact(f"timing_{how}_{sync_point}", {"mechanism": mechanism, "sync_point": sync_point, "events": getattr(events, "__qualname__", str(events)),
                                 "forward_ms": FORWARD_MS, "optimizer_ms_injected": OPTIMIZER_MS,
                                 "compute_ms_median": compute, "optimizer_ms_median": optimizer,
                                 "sync_wait_ms_median": sync, "step_ms_mean": per_step_hook_ms,
                                 "data_wait_ms_median": statistics.median(r.data_wait_ms for r in recs),
                                 "wall_ms_per_step": per_step_wall_ms})
    # Compute holds the forward's delay (plus a small backward); the optimizer section its own.
    # The rehearsal's "device" is a shared CPU whose busy loop can only run long: there the
    # lower bounds alone mean something.
    hi = 1.6 if rig.is_cuda else float("inf")
    assert 0.9 <= compute / FORWARD_MS <= hi, (compute, FORWARD_MS)
    assert 0.9 <= optimizer / OPTIMIZER_MS <= hi, (optimizer, OPTIMIZER_MS)
    # One rank waits for nobody: sync wait is the all-reduce alone (or nothing).
    assert 0.0 <= sync < (0.25 * FORWARD_MS if rig.is_cuda else compute), sync
    # The device-timed steps add up to the wall clock of the run.
    assert 0.8 <= per_step_hook_ms / per_step_wall_ms <= 1.25, (per_step_hook_ms, per_step_wall_ms)

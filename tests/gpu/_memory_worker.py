"""torchrun target of tests/gpu/test_memory_caps.py: tests/backend/_memory_worker.py's job
(a fake card per rank: ``--memory TOTAL:FIXED:PER_SAMPLE`` bytes, a step needs FIXED +
PER_SAMPLE * local batch) on a real CUDA device. Every rank shares ``cuda:0`` over gloo;
TOTAL becomes the rank's allocator limit (``torch.cuda.set_per_process_memory_fraction``)
and the memory total it reports, each step really allocates what it needs, the peak is
read from torch's allocator and an out-of-memory error is the allocator's own. In the
rehearsal (no CUDA) the fake allocator of tests/helpers/fake_memory.py stands in.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.fake_memory import FakeDeviceMemory  # noqa: E402
from tests.helpers.workers import init_attempt_group  # noqa: E402
from trainer_hook import RebalanceHook  # noqa: E402
from trainer_hook.memory import TorchCudaMemory  # noqa: E402


class CappedCudaMemory(TorchCudaMemory):
    """cuda:0's allocator, limited to ``total`` bytes for this process."""

    def __init__(self, total: int) -> None:
        super().__init__(0)
        device_total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, total / device_total), 0)
        self._total = min(total, device_total)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--token", default=None)
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--memory", required=True)
    p.add_argument("--step-ms", type=float, default=10.0)
    args = p.parse_args()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank = init_attempt_group("gpu_memory_worker")
    total, fixed, per = (int(v) for v in args.memory.split(",")[rank].split(":"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        source: TorchCudaMemory | FakeDeviceMemory = CappedCudaMemory(total)
    else:
        device = torch.device("cpu")
        source = FakeDeviceMemory(total_bytes=total, fixed_bytes=fixed, bytes_per_sample=per)
    hook = RebalanceHook(server=args.server, job=args.job, global_batch_size=args.global_batch_size,
                         token=args.token, memory_source=source, memory_every=4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=gen)
    dataset = TensorDataset(x, x[:, :1])
    model = hook.attach(DDP(torch.nn.Linear(8, 1).to(device), device_ids=[0] if cuda else None))
    sampler = hook.batch_sampler(dataset, shuffle=True, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    print(f"[gpu_memory_worker] rank {rank} attempt {attempt} starts on {device}", flush=True)
    while True:
        for xb, yb in DataLoader(dataset, batch_sampler=sampler):
            with hook.step() as k:
                lo, hi = sampler.local_bounds(k)
                if isinstance(source, FakeDeviceMemory):
                    source.allocate(hi - lo)
                else:  # the allocator's own out-of-memory error past the limit
                    held = torch.empty(fixed + per * (hi - lo), dtype=torch.uint8, device=device)
                time.sleep(args.step_ms / 1e3)
                xb, yb = xb.to(device), yb.to(device)
                torch.nn.functional.mse_loss(model(xb), yb).backward()
                opt.step()
                opt.zero_grad()
                if cuda:
                    del held


if __name__ == "__main__":
    sys.exit(main())

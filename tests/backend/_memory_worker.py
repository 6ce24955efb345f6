"""A torchrun worker whose device memory is the fake allocator of tests.helpers.fake_memory.

Like trainer_hook.demo_worker (injected per-sample compute time per rank), plus a fake
device per rank: ``--memory TOTAL:FIXED:PER_SAMPLE`` (bytes), one per rank, comma
separated, or ``none`` for a rank that measures none. Each step allocates ``FIXED + PER_SAMPLE * local batch``; past ``TOTAL`` it
raises torch's out-of-memory error inside ``hook.step()``, as a real allocator would.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.fake_memory import FakeDeviceMemory  # noqa: E402
from tests.helpers.workers import init_attempt_group  # noqa: E402
from trainer_hook import RebalanceHook  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--token", default=None)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--speeds", required=True)
    p.add_argument("--memory", required=True)
    p.add_argument("--per-sample-ms", type=float, default=1.0)
    p.add_argument("--fixed-ms", type=float, default=1.0)
    args = p.parse_args()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank = init_attempt_group("memory_worker")
    speed = float(args.speeds.split(",")[rank])
    spec = args.memory.split(",")[rank]
    mem: FakeDeviceMemory | None = None
    if spec != "none":  # "none": a rank that measures no memory (a CPU rank)
        total, fixed, per = (int(v) for v in spec.split(":"))
        mem = FakeDeviceMemory(total_bytes=total, fixed_bytes=fixed, bytes_per_sample=per)
    hook = RebalanceHook(server=args.server, job=args.job, global_batch_size=args.global_batch_size,
                         token=args.token, memory_source=mem, memory_every=4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=gen)
    dataset = TensorDataset(x, x[:, :1])
    model = hook.attach(DDP(torch.nn.Linear(8, 1)))
    sampler = hook.batch_sampler(dataset, shuffle=True, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    print(f"[memory_worker] rank {rank} attempt {attempt} starts", flush=True)
    while hook.batch_index < args.steps:
        for xb, yb in DataLoader(dataset, batch_sampler=sampler):
            with hook.step() as k:
                lo, hi = sampler.local_bounds(k)
                if mem is not None:
                    mem.allocate(hi - lo)  # raises torch.OutOfMemoryError past the fake card's memory
                time.sleep((args.fixed_ms + (hi - lo) * args.per_sample_ms / speed) / 1e3)
                torch.nn.functional.mse_loss(model(xb), yb).backward()
                opt.step()
                opt.zero_grad()
            if hook.batch_index >= args.steps:
                break
    hook.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

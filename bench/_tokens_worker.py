"""torchrun target of ``python -m bench.tokens --real``: a variable-length job through the hook.

Each rank trains a tiny DDP model (gloo, CPU) on samples whose cost is their token count
(``hook.batch_sampler(..., sample_cost=lengths)``), streaming to a real backend. Its
"device" is modelled by a sleep of ``fixed_ms + work * ms_per_token / speed`` per step,
``work`` being the tokens the sampler gave the rank for that batch. A sleep, not real
compute: the four ranks share two CPU cores with everything else on the machine, so compute
proportional to tokens would run at whatever speed the scheduler gave each rank at that
moment, not the injected one; a sleep, like an accelerator, keeps its speed when the host is
busy, so the true speeds (and the oracle) are known. Rank 0 writes every rank's per-step
records, the injected time and the placement timeline to ``--result``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from bench.tokens import lengths
from trainer_hook import RebalanceHook


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--speeds", required=True)
    p.add_argument("--ms-per-token", type=float, required=True)
    p.add_argument("--fixed-ms", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result", required=True)
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    speed = [float(s) for s in args.speeds.split(",")][rank]
    lens = lengths(random.Random(args.seed), args.samples)
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.samples, 16, generator=gen)
    y = x[:, :1] - 0.5 * x[:, 1:2]
    hook = RebalanceHook(server=args.server, job=args.job, global_batch_size=args.global_batch_size,
                         total_steps=args.steps)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    hook.attach(model)
    sampler = hook.batch_sampler(TensorDataset(x, y), shuffle=True, seed=args.seed, sample_cost=lens)
    loader = DataLoader(TensorDataset(x, y), batch_sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    records: list[dict[str, Any]] = []
    while hook.batch_index < args.steps:
        for xb, yb in loader:
            with hook.step() as k:
                work = sampler.local_work(k)
                injected = args.fixed_ms + work * args.ms_per_token / speed if sampler.local_size(k) else 0.0
                time.sleep(injected / 1e3)  # the rank's device at its injected speed
                torch.nn.functional.mse_loss(model(xb), yb).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if hook.last_step is not None:
                records.append({**asdict(hook.last_step), "injected_ms": injected, "work": work,
                                "shares": hook.shares})
            if hook.batch_index >= args.steps:
                break
    hook.close()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        out = {"records": gathered, "timeline": [
            {"version": t.version, "start_batch": t.start_batch, "shares": list(t.shares)}
            for t in hook.schedule.timeline()]}
        with open(args.result + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(args.result + ".tmp", args.result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

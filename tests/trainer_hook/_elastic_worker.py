"""torchrun target for the TorchElastic restart test.

First run (TORCHELASTIC_RESTART_COUNT=0): trains until ``OUT/crash`` exists, then rank 1
dies (torchrun restarts every worker). Restarted run: trains ``--steps`` batches and
each rank writes what it started with to ``OUT/restart{rank}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.workers import init_attempt_group
from trainer_hook import RebalanceHook


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart > 0:
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(40, exit=True, file=sys.stderr)  # a hang shows where
    rank = init_attempt_group("rebalancer-test")
    hook = RebalanceHook(server=args.server, job="elastic", global_batch_size=12)
    model = DDP(torch.nn.Linear(3, 1))
    hook.attach(model)
    ds = TensorDataset(torch.randn(240, 3), torch.randn(240, 1))
    sampler = hook.batch_sampler(ds)
    loader = DataLoader(ds, batch_sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crash = os.path.join(args.out, "crash")
    first = hook.schedule.at(0)
    while restart > 0 and hook.batch_index < args.steps or restart == 0:
        for x, y in loader:
            with hook.step():
                time.sleep(0.02)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            if restart == 0 and rank == 1 and os.path.exists(crash):
                os._exit(3)  # a rank dies; torchrun restarts the whole group
            if restart > 0 and hook.batch_index >= args.steps:
                break
    with open(os.path.join(args.out, f"restart{rank}.json"), "w") as f:
        json.dump({"restart": restart, "first": [first.version, list(first.shares)], "acks": hook.acks,
                   "local": [r.local_batch_size for r in hook.history]}, f)
    hook.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""torchrun target for the what-if test (tests/backend/test_causes_torchrun.py; gloo, CPU).

Three ranks train one small model in three phases of ``--phase-steps`` steps each, writing
every step record (``hook.history``, offline) to ``rankN.json``:
- ``data_wait``: rank 1's loader sleeps ``--loader-ms`` per batch (the cause);
- ``clean``: no cause (the cause removed for real);
- ``slow_rank``: rank 2 computes twice as long per sample (the cause).
Compute is a sleep per sample (``--sample-ms``), so a step's parts are known and a loaded
machine's CPU contention moves them little.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_hook import RebalanceHook

PHASES = ("data_wait", "clean", "slow_rank")
GLOBAL_BATCH = 12


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
        self.loader_s = 0.0  # slept per batch (in the collate function)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--phase-steps", type=int, default=25)
    p.add_argument("--loader-ms", type=float, default=40.0)
    p.add_argument("--sample-ms", type=float, default=8.0)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    hook = RebalanceHook(job="causes", global_batch_size=GLOBAL_BATCH, history=1024)
    model = DDP(torch.nn.Linear(8, 1))
    hook.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    total = args.phase_steps * len(PHASES)
    ds = Data(GLOBAL_BATCH * total)

    def collate(items: list[torch.Tensor]) -> torch.Tensor:
        time.sleep(ds.loader_s)  # inside the loader's next(): the hook times it as the loader's
        return torch.stack(items)

    loader = hook.data_loader(ds, shuffle=False, collate_fn=collate)
    phase_of: dict[int, str] = {}
    it = iter(loader)
    for k in range(total):
        phase = PHASES[k // args.phase_steps]
        phase_of[k] = phase
        ds.loader_s = args.loader_ms / 1e3 if phase == "data_wait" and rank == 1 else 0.0
        x = next(it)  # no workers: batch k is made here, never ahead
        with hook.step():
            per_sample = args.sample_ms * (2.0 if phase == "slow_rank" and rank == 2 else 1.0)
            time.sleep(per_sample * len(x) / 1e3)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    hook.close()
    recs = [{**r.to_dict(), "phase": phase_of[r.batch_index]} for r in hook.history]
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(recs, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

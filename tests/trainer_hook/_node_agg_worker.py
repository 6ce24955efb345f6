"""A torchrun rank for tests/trainer_hook/test_node_agg_torchrun.py: a small DDP job whose
local rank 0 stops its node agent once the file ``OUT/stop-agent`` exists (the fault), and
every rank writes where its transport ended up to ``OUT/rank-R.json``.

Usage: torchrun --nproc-per-node 4 tests/trainer_hook/_node_agg_worker.py SERVER JOB STEPS OUT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from trainer_hook import RebalanceHook
from trainer_hook.node_agg import NodeAgent


def main() -> int:
    server, job, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    data = TensorDataset(x, x[:, :1])
    hook = RebalanceHook(server=server, job=job, global_batch_size=16, flush_interval_s=0.1)
    model = DDP(torch.nn.Linear(8, 1))
    hook.attach(model)
    loader = DataLoader(data, batch_sampler=hook.batch_sampler(data, shuffle=True, seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    transport = hook._conn.transport
    agent = transport.relay if transport is not None else None
    stopped_at = None
    while hook.batch_index < steps:
        for xb, yb in loader:
            with hook.step() as k:
                torch.nn.functional.mse_loss(model(xb), yb).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                time.sleep(0.015)
            if isinstance(agent, NodeAgent) and stopped_at is None and (out / "stop-agent").exists():
                agent.stop("the test's fault")
                stopped_at = k
            if hook.batch_index >= steps:
                break
    hook.close()
    (out / f"rank-{rank}.json").write_text(json.dumps({
        "rank": rank, "agent": isinstance(agent, NodeAgent), "stopped_at": stopped_at,
        "url": transport.url if transport is not None else None,
        "connects": transport.connects if transport is not None else 0, "dropped": hook.dropped,
        "pid": os.getpid(),
    }))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

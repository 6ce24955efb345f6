"""A plain FSDP2 script with no rebalancer import: what `rebalancer run` monitors unchanged.

Usage: torchrun --nproc-per-node 2 tests/integrations/_plain_fsdp2_job.py STEPS [SLOW_MS]
Rank 0 prints the final loss (float64, deterministic). SLOW_MS: rank 1 computes that much
longer each step (a straggler).
"""

import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

steps = int(sys.argv[1])
slow_s = float(sys.argv[2]) / 1e3 if len(sys.argv) > 2 else 0.0
dist.init_process_group("gloo")
g = torch.Generator().manual_seed(0)
ds = TensorDataset(torch.randn(steps * 16, 8, generator=g, dtype=torch.float64),
                   torch.randn(steps * 16, 1, generator=g, dtype=torch.float64))
loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, shuffle=False))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
fully_shard(model[0])
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    if dist.get_rank() == 1:
        time.sleep(slow_s)  # before backward: its reduce-scatters, and so its peer's, come late
    loss.backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.02)  # a step long enough for the dashboard to see the job live
if dist.get_rank() == 0:
    print(f"final loss {loss.item():.12f}", flush=True)
dist.destroy_process_group()

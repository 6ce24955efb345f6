"""A plain DDP script with no rebalancer import: what `rebalancer run` monitors unchanged.

Usage: torchrun --nproc-per-node 2 tests/integrations/_plain_ddp_job.py STEPS [EXIT_CODE [SLOW_MS]]
Rank 0 prints the final loss (float64, deterministic) and the script exits with EXIT_CODE.
SLOW_MS: rank 1 computes that much longer each step (a straggler).
"""

import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

steps = int(sys.argv[1])
slow_s = float(sys.argv[3]) / 1e3 if len(sys.argv) > 3 else 0.0
dist.init_process_group("gloo")
g = torch.Generator().manual_seed(0)
ds = TensorDataset(torch.randn(steps * 16, 8, generator=g, dtype=torch.float64),
                   torch.randn(steps * 16, 1, generator=g, dtype=torch.float64))
loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, shuffle=False))
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1).double())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    if dist.get_rank() == 1:
        time.sleep(slow_s)  # before backward: its gradients, and so the all-reduce, come late
    loss.backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.02)  # a step long enough for the dashboard to see the job live
if dist.get_rank() == 0:
    print(f"final loss {loss.item():.12f}", flush=True)
dist.destroy_process_group()
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)

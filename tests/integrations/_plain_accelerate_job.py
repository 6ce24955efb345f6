"""A plain Hugging Face Accelerate script with no rebalancer import: what `rebalancer run`
monitors unchanged.

Usage: torchrun --nproc-per-node 2 tests/integrations/_plain_accelerate_job.py STEPS [SLOW_MS]
Rank 0 prints the final loss (float64, deterministic). SLOW_MS: rank 1 computes that much
longer each step (a straggler).
"""

import sys
import time

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

steps = int(sys.argv[1])
slow_s = float(sys.argv[2]) / 1e3 if len(sys.argv) > 2 else 0.0
accelerator = Accelerator(cpu=True)
g = torch.Generator().manual_seed(0)
ds = TensorDataset(torch.randn(steps * 16, 8, generator=g, dtype=torch.float64),
                   torch.randn(steps * 16, 1, generator=g, dtype=torch.float64))
torch.manual_seed(0)
model = torch.nn.Linear(8, 1).double()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model, opt, loader = accelerator.prepare(model, opt, DataLoader(ds, batch_size=8, shuffle=False))
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    if accelerator.process_index == 1:
        time.sleep(slow_s)  # before backward: its gradients, and so the all-reduce, come late
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    time.sleep(0.02)  # a step long enough for the dashboard to see the job live
if accelerator.is_main_process:
    print(f"final loss {loss.item():.12f}", flush=True)
accelerator.end_training()

"""A plain one-process loop with no rebalancer import (the browser test's zero-code job).

Usage: python tests/integrations/_plain_single_job.py STEPS
"""

import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

steps = int(sys.argv[1])
ds = TensorDataset(torch.randn(steps * 4, 8), torch.randn(steps * 4, 1))
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in DataLoader(ds, batch_size=4):
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.01)
print("done", flush=True)

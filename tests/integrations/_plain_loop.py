"""The loop of the plain scripts (``_plain_ddp_job.py``, ``_plain_fsdp2_job.py``): no
rebalancer import, what ``rebalancer run`` monitors unchanged. Each script wraps its model
its own way; data, optimizer and steps are the same (float64, deterministic)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def train(wrap: Callable[[], torch.nn.Module], steps: int, slow_s: float) -> None:
    """``steps`` steps of the model ``wrap()`` builds; rank 1 computes ``slow_s`` longer each
    step (a straggler); rank 0 prints the final loss."""
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(steps * 16, 8, generator=g, dtype=torch.float64),
                       torch.randn(steps * 16, 1, generator=g, dtype=torch.float64))
    loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, shuffle=False))
    torch.manual_seed(0)
    model = wrap()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        if dist.get_rank() == 1:
            time.sleep(slow_s)  # before backward: its gradients, and so the collectives, come late
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.02)  # a step long enough for the dashboard to see the job live
    if dist.get_rank() == 0:
        print(f"final loss {loss.item():.12f}", flush=True)
    dist.destroy_process_group()

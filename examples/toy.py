"""What the examples share that is not about Rebalancer: a toy regression workload that
runs on any CPU, the command line they all take, and the line each prints per epoch.
Every example imports it from beside itself (``import toy``); put your own model and data
where they call it."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.utils.data import TensorDataset

__all__ = ["args", "requested_split", "data", "model", "epoch_line"]


def args(description: str, job: str, global_batch_size: int, *, epochs: type = int,
         request: bool = True) -> argparse.ArgumentParser:
    """--server, --job, --global-batch-size, --epochs and (``request``) --request; add your own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--server", default=None, help="backend URL (default: REBALANCER_SERVER, else offline)")
    p.add_argument("--job", default=job)
    p.add_argument("--global-batch-size", type=int, default=global_batch_size)
    p.add_argument("--epochs", type=epochs, default=2)
    if request:
        p.add_argument("--request", default=None, metavar="STEP:S0,S1,...",
                       help="rank 0 asks for this split at STEP (try it offline, e.g. 3:96,32)")
    return p


def requested_split(request: str | None) -> tuple[int, list[int]]:
    """``"STEP:S0,S1,..."`` as (STEP, shares); (-1, []) without one."""
    if not request:
        return -1, []
    step, shares = request.split(":")
    return int(step), [int(s) for s in shares.split(",")]


def data(n: int) -> TensorDataset:
    """``n`` points of a noisy linear map from 16 features to 1."""
    x = torch.randn(n, 16)
    return TensorDataset(x, x @ torch.randn(16, 1) + 0.1 * torch.randn(n, 1))


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def epoch_line(epoch: Any, hook: Any, **more: Any) -> str:
    """``epoch E: batch K, <more>, placement vN [shares]``."""
    parts = [f"batch {hook.batch_index}", *(f"{k} {v}" for k, v in more.items())]
    return f"epoch {epoch}: {', '.join(parts)}, placement v{hook.placement_version} {hook.shares}"

"""A plain FSDP2 script with no rebalancer import: what `rebalancer run` monitors unchanged.

Usage: torchrun --nproc-per-node 2 tests/integrations/_plain_fsdp2_job.py STEPS [SLOW_MS]
Rank 0 prints the final loss (float64, deterministic). SLOW_MS: rank 1 computes that much
longer each step (a straggler).
"""

import sys

import torch
from torch.distributed.fsdp import fully_shard

from _plain_loop import train  # beside this script


def sharded() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    fully_shard(model[0])
    fully_shard(model)
    return model


train(sharded, int(sys.argv[1]), float(sys.argv[2]) / 1e3 if len(sys.argv) > 2 else 0.0)

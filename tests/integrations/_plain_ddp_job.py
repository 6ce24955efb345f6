"""A plain DDP script with no rebalancer import: what `rebalancer run` monitors unchanged.

Usage: torchrun --nproc-per-node 2 tests/integrations/_plain_ddp_job.py STEPS [EXIT_CODE [SLOW_MS]]
Rank 0 prints the final loss (float64, deterministic) and the script exits with EXIT_CODE.
SLOW_MS: rank 1 computes that much longer each step (a straggler).
"""

import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _plain_loop import train  # beside this script

train(lambda: DDP(torch.nn.Linear(8, 1).double()), int(sys.argv[1]),
      float(sys.argv[3]) / 1e3 if len(sys.argv) > 3 else 0.0)
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)

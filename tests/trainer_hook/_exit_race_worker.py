"""One-process gloo job that ends while gloo's worker thread still holds the comm hook's
callback (see GradientState.release_callbacks), then exits at once.

Usage: python -m tests.trainer_hook._exit_race_worker {close|no-close} STORE_FILE
Exit code 3: the race was not reached in 200 steps (the gloo thread always dropped the
callback first); the caller runs it again.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_hook import RebalanceHook


def main() -> int:
    mode, store = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    hook = RebalanceHook(global_batch_size=4)
    model = DDP(torch.nn.Linear(4, 1))
    hook.attach(model)
    x = torch.randn(4, 4)
    resting = sys.getrefcount(hook._grads._done_cb)
    sys.setswitchinterval(1000.0)  # the main thread keeps the GIL unless it blocks
    for _ in range(200):
        with hook.step():
            model(x).sum().backward()
        if sys.getrefcount(hook._grads._done_cb) > resting:
            break  # gloo's thread still holds the callback and waits for the GIL
    else:
        sys.setswitchinterval(0.005)
        return 3
    if mode == "close":
        hook.close()
        dist.destroy_process_group()
    return 0  # no-close: the interpreter's exit closes the hook


if __name__ == "__main__":
    sys.exit(main())

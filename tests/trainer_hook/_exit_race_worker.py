"""One-process gloo job that ends while gloo's worker thread still holds the comm hook's
callback (see GradientState.release_callbacks), then exits at once.

Usage: python -m tests.trainer_hook._exit_race_worker {close|no-close|futures} STORE_FILE
Exit code 3: the race was not reached in 200 steps (the gloo thread always dropped the
callback first); the caller runs it again. ``futures``: four steps with the comm hook's
futures recorded; prints which of them the hook still keeps after close().
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_hook import RebalanceHook, gradients


def futures(store: str) -> int:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    made: list[list[object]] = []
    weighted = gradients.weighted_allreduce_hook

    def recording(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        fut = weighted(state, bucket)
        made[-1].append(fut)
        return fut

    gradients.weighted_allreduce_hook = recording
    hook = RebalanceHook(global_batch_size=4)
    model = DDP(torch.nn.Linear(4, 1))
    hook.attach(model)
    for _ in range(4):
        made.append([])
        with hook.step():
            model(torch.randn(4, 4)).sum().backward()
    hook.close()
    state = hook._grads
    kept = [all(any(f is g for g in state._futs + state._prev_futs) for f in step) for step in made]
    print("futures kept per step:", " ".join("yes" if k else "no" for k in kept))
    dist.destroy_process_group()
    return 0


def main() -> int:
    mode, store = sys.argv[1], sys.argv[2]
    if mode == "futures":
        return futures(store)
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

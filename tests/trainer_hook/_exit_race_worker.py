"""One-process gloo job that ends while gloo's worker thread still holds the comm hook's
callback (see GradientState.release_callbacks), then exits at once.

Usage: python -m tests.trainer_hook._exit_race_worker {close|no-close|dropped|futures} STORE_FILE
``close``/``no-close``: the race forced (see main), then the exit with or without
``hook.close()``; it prints whether the race was reached. ``dropped``: no-close, and a
garbage collection after main() returned, before the exit handler. ``futures``: four steps with the
comm hook's futures recorded; prints which of them the hook still keeps after close().
``peer``: rank 1 of the forced race's gradient group (started by ``main``).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_hook import RebalanceHook, gradients

STEPS = 3


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


def _peer_group(path: str, rank: int) -> Any:
    """A 2-rank gloo group of its own (rank 0 here, rank 1 the peer process), on loopback."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timedelta(seconds=60)
    store = dist.FileStore(path, 2)
    return store, dist.ProcessGroupGloo(store, rank, 2, opts)


def peer(store_path: str) -> int:
    """Rank 1 of the gradient group: joins each step's all-reduce when rank 0 says so."""
    store, pg = _peer_group(store_path, 1)
    for k in range(STEPS):
        numel = int(store.get(f"go{k}"))
        pg.allreduce([torch.zeros(numel)]).wait()
    return 0


def main() -> int:
    mode, store = sys.argv[1], sys.argv[2]
    if mode == "futures":
        return futures(store)
    if mode == "peer":
        return peer(store)
    # The interleaving, forced. The gradient all-reduce runs in a 2-rank gloo group whose
    # rank 1 (a peer process) joins only once rank 0 has handed DDP the step's future, so
    # gloo's worker thread, not this one, always completes it and runs the callback. A
    # second callback on that future, run by gloo's thread while the first one's guard is
    # still alive, holds it until this thread has finished the last step, then lets it go
    # on while this thread keeps the GIL (a huge switch interval) and heads for exit: gloo's
    # thread still holds the callback and waits for the GIL, every run.
    Path(store + ".peer").unlink(missing_ok=True)  # a file store left by an earlier run
    peer_proc = subprocess.Popen([sys.executable, "-m", "tests.trainer_hook._exit_race_worker", "peer",
                                  store + ".peer"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    peer_store, pg = _peer_group(store + ".peer", 0)
    entered, release = threading.Event(), threading.Event()
    main_thread = threading.current_thread()
    held_by: list[str] = []

    def hold(_fut: Any) -> None:
        held_by.append("gloo" if threading.current_thread() is not main_thread else "main")
        entered.set()
        release.wait(30)

    weighted = gradients.weighted_allreduce_hook
    step = [0]

    def peered(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        fut = weighted(state, bucket)
        if step[0] == STEPS - 1:
            fut.add_done_callback(hold)  # not complete yet: the peer has not joined
        peer_store.set(f"go{step[0]}", str(bucket.buffer().numel()))
        return fut

    gradients.weighted_allreduce_hook = peered
    hook = RebalanceHook(global_batch_size=4)
    model = DDP(torch.nn.Linear(4, 1))
    hook.attach(model)
    hook._grads.process_group = pg
    x = torch.randn(4, 4)
    for k in range(STEPS):
        step[0] = k
        with hook.step():
            model(x).sum().backward()
    assert entered.wait(30), "gloo's thread never ran the held callback"
    peer_proc.wait(60)  # the peer's part ended with the last all-reduce
    resting = hook._grads._cb_refs
    sys.setswitchinterval(1000.0)  # this thread keeps the GIL unless it blocks
    release.set()
    holding = sys.getrefcount(hook._grads._done_cb) > resting
    print(f"race reached: callback run by {held_by[0]}, still held at exit: {'yes' if holding else 'no'}",
          flush=True)
    if mode == "close":
        hook.close()
        dist.destroy_process_group()
    return 0  # no-close, dropped: the interpreter's exit closes the hook


if __name__ == "__main__":
    code = main()
    if sys.argv[1] == "dropped":
        # The script's hook and model were main()'s locals, garbage now: a collection
        # before the exit handler runs (any allocation may start one) takes them.
        gc.collect()
    sys.exit(code)

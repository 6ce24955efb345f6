"""The fourth road to the exit abort, forced: a gloo worker thread frees a Python-made
tensor after finalisation has begun.

A one-rank gloo group all-reduces large tensors asynchronously and the script drops the
tensors and the works at once and returns: gloo's threads still run the works, and as each
is done its thread frees the tensor, which takes the GIL. An object whose ``__del__`` sleeps,
collected while the interpreter finalises, keeps finalisation going long enough that the
release lands inside it whenever the all-reduce is still running when the script returns
(8 runs in 16 here: a one-rank all-reduce is sometimes done before). The hook's exit handler (``REBALANCER_EXIT_SETTLE_S``)
waits for gloo's thread before finalisation; with the wait off, the process aborts.

Usage: python -m tests.trainer_hook._exit_settle_job STORE_FILE [N_ELEMENTS]
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from trainer_hook import RebalanceHook


class _SlowFinaliser:
    def __del__(self) -> None:
        time.sleep(3.0)  # the GIL released, during finalisation


_slow = _SlowFinaliser()  # a module global: collected while the interpreter finalises


def main() -> None:
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
    RebalanceHook(global_batch_size=8).close()  # registers the exit handler, as any hook does
    t = torch.ones(int(sys.argv[2]) if len(sys.argv) > 2 else 60_000_000)
    work = dist.all_reduce(t, async_op=True)
    del t, work
    print("exit-settle-job: returning with the all-reduce in flight", flush=True)


if __name__ == "__main__":
    main()

"""Gradient weighting: each rank's gradient counts in proportion to its share of B.

With uneven local batches, DDP's default hook (sum, then divide by world size) no longer
gives the global-batch mean. The comm hook here multiplies each bucket by this rank's
weight (``shares[rank] / B`` for the batch being trained) and all-reduces with SUM, so
the result is the global-batch mean whatever the split (DESIGN.md invariant 1). It also
timestamps each bucket hand-off and each reduction's completion, which is how compute
time is told apart from the wait inside synchronisation (invariant 4).

Where a comm hook cannot be used (another library owns DDP's hook), the loss-scaling
path gives the same math: multiply the local mean loss by ``world_size * weight`` and
let the default averaging all-reduce divide by world size again.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GradientState", "weighted_allreduce_hook", "register_comm_hook", "register_grad_timer"]


class GradientState:
    """Per-step state the comm hook reads (weight) and writes (timestamps).

    The hook sets ``weight`` at the start of every step and calls ``reset()``. On CPU
    the timestamps are ``time.perf_counter()`` values; on CUDA the hook records events
    (read a step later, never synchronising) in ``grad_event``/``done_event``.
    """

    __slots__ = (
        "process_group", "weight", "_pg", "_opts", "last_bucket_t", "last_done_t", "buckets_seen",
        "repeated_bucket", "grad_event", "done_event", "cuda", "_done_cb", "_cb_refs",
    )

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self._pg: Any = None
        self._opts: Any = None
        self.weight = 1.0
        self.cuda = False
        self._done_cb = self._mark_done  # bound once, not per bucket
        self._cb_refs = sys.getrefcount(self._done_cb)  # references with no future holding it
        self.reset()

    def reset(self) -> None:
        self.last_bucket_t: float | None = None
        self.last_done_t: float | None = None
        # Bit i set: bucket i was all-reduced in this step (an int, so a reset allocates nothing).
        self.buckets_seen = 0
        self.repeated_bucket = False
        self.grad_event: Any = None
        self.done_event: Any = None

    # Called on the gloo/NCCL completion thread (or inline when the reduction is already
    # complete): it holds the GIL the training thread wants, so it does as little as it can.
    def release_callbacks(self, timeout_s: float = 5.0) -> bool:
        """Wait until no communication thread still holds the completion callback.

        ``Future.then`` wraps the Python callback in a guard that the backend's worker
        thread (gloo's) destroys after running it, taking the GIL to do so. A thread that
        asks for the GIL once the interpreter is finalising is ended by
        ``pthread_exit`` inside that C++ destructor, and the process aborts with
        ``terminate called without an active exception``. After the last step the main
        thread may hold the GIL all the way to exit, so the hook waits here (the GIL
        released) until the reference count of the callback is back to its resting
        value. Returns False if ``timeout_s`` passed first.
        """
        deadline = time.monotonic() + timeout_s
        while sys.getrefcount(self._done_cb) > self._cb_refs:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def _mark_done(self, fut: torch.futures.Future[Any]) -> torch.Tensor:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.done_event = ev
        else:
            self.last_done_t = _now()
        return fut.value()[0]  # type: ignore[no-any-return]


_now = time.perf_counter


# No annotations: DDP compares them with the real classes, and this module's
# ``from __future__ import annotations`` turns them into strings it rejects.
def weighted_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: ``bucket *= weight``, all-reduce SUM asynchronously, return the future.

    ``state`` is a GradientState, ``bucket`` a ``dist.GradBucket``; returns a
    ``torch.futures.Future[torch.Tensor]``.
    """
    bit = 1 << bucket.index()
    seen = state.buckets_seen
    if seen & bit:
        # A second all-reduce of the same bucket inside one step means gradient
        # accumulation without no_sync(); the step's exit reports it.
        state.repeated_bucket = True
    state.buckets_seen = seen | bit
    buf = bucket.buffer()
    if buf.is_cuda:
        state.cuda = True
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        state.grad_event = ev
    else:
        state.last_bucket_t = _now()
    buf.mul_(state.weight)
    pg = state._pg
    if pg is None:
        # Straight to the ProcessGroup: dist.all_reduce's Python checks and logging cost
        # more than the reduction launch itself on the hot path.
        pg = state._pg = state.process_group if state.process_group is not None else dist.group.WORLD
        opts = state._opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
    return pg.allreduce([buf], state._opts).get_future().then(state._done_cb)


def _is_ddp(model: Any) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def register_comm_hook(model: Any, state: GradientState) -> None:
    """Install the weighted hook on a DDP model; clear errors for setups it cannot keep exact."""
    name = type(model).__name__
    if "FullyShardedDataParallel" in name or name == "FSDPModule":
        raise ValueError(
            f"{name} is not supported: FSDP reduce-scatters gradients without a DDP comm hook, so "
            "uneven local batches cannot be weighted exactly. Use DistributedDataParallel."
        )
    if not _is_ddp(model):
        raise ValueError(
            f"attach() expected a torch.nn.parallel.DistributedDataParallel model, got {name}. "
            "Wrap the model in DDP first, or use attach(model, gradients='loss_scale') and multiply "
            "your loss by hook.loss_weight() if something else averages gradients across ranks."
        )
    try:
        model.register_comm_hook(state, weighted_allreduce_hook)
    except RuntimeError as exc:
        raise RuntimeError(
            "This DDP model already has a communication hook registered, and DDP allows only one. "
            "The rebalancer's hook must weight every bucket by the rank's share of the global batch, "
            "otherwise uneven batches change the math. Remove the other register_comm_hook() call, "
            "or use attach(model, gradients='loss_scale') with hook.loss_weight()."
            f" (DDP said: {exc})"
        ) from None


def register_grad_timer(model: torch.nn.Module, state: GradientState, *, count: int = 4) -> list[Any]:
    """Timestamp the end of backward without a comm hook (loss-scaling path, one process).

    Backward produces the first parameters' gradients last, so hooks on the first few
    parameters mark when local gradients are ready; cheaper than hooking every one.
    """

    def mark(_: torch.Tensor) -> None:
        state.last_bucket_t = time.perf_counter()

    handles = []
    for p in list(model.parameters())[:count]:
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(mark))
    return handles

"""Micro-batch placements: a share counts fixed-shape micro-batches of a rank's own stream.

With ``RebalanceHook(micro_batches=M)`` every optimizer step trains M micro-batches over
all ranks; rank r trains ``shares[r]`` of them (its own gradient accumulation count), read
from its own stream (an IterableDataset's loader, a ``StatefulDataLoader``, any
iterator). A placement changes only those counts, at the batch index rank 0 decided
(the same schedule and exchange as sample placements), so a compiled model sees one shape
all run long. ``hook.micro_batches(source)`` inside ``hook.step()`` takes this step's
micro-batches from the source, turns gradient synchronisation off for all but the last
(DDP's ``require_backward_grad_sync``, FSDP2's ``set_requires_gradient_sync``) and, with
one process, scales the accumulated gradients as the comm hook would. Each micro-batch's
gradient is weighted ``1 / M``: a per-micro-batch mean loss then gives the global mean
over samples; ``hook.token_loss_weight`` gives the mean over valid tokens.

A drained rank (share 0) trains its last micro-batch again with weight 0 (or, before it
has one, a micro-batch it peeks from its stream and keeps for later), so it still joins
the gradient collective and the shape stays the same. Nothing here needs a sample index:
what a rank consumed is counted, and ``state_dict`` carries that count, the source's own
``state_dict()`` when it has one, and the micro-batches peeked but not trained yet.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["MicroBatches", "MicroBatchStream", "StreamEnded", "batch_signature", "refuse_micro_batches"]


def refuse_micro_batches(hook: Any, adapter: str) -> None:
    """ValueError for a framework adapter given a ``micro_batches=M`` hook: the adapter owns
    the loop and a loader that splits samples, which such a hook does not do."""
    config = getattr(hook, "config", None)
    if getattr(config, "micro_batches", None) is not None:
        raise ValueError(
            f"{adapter} balances samples (it owns the loop and splits each batch's samples), but this "
            f"hook was created with micro_batches={config.micro_batches} (shares count micro-batches). "  # type: ignore[union-attr]
            "Write the training loop with `for mb in hook.micro_batches(stream)` inside `with hook.step():` "
            "(docs/streaming.md; with Accelerate, prepare the model and optimizer only), or create the "
            "hook without micro_batches to balance samples.")


class StreamEnded(RuntimeError):
    """A rank's stream ran out before it gave the micro-batches its share asks for."""


def batch_signature(batch: Any) -> Any:
    """The shapes and dtypes of every tensor in a micro-batch (nested tuples, lists, dicts),
    comparable with ``==``; other leaves count by their type only."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", tuple(batch.shape), str(batch.dtype))
    if isinstance(batch, dict):
        return ("dict", tuple((k, batch_signature(v)) for k, v in batch.items()))
    if isinstance(batch, (tuple, list)):
        return (type(batch).__name__, tuple(batch_signature(v) for v in batch))
    return ("leaf", type(batch).__name__)


class MicroBatchStream:
    """One rank's source of micro-batches: its iterator, what it consumed, what it peeked.

    ``resume`` is the ``stream`` entry of a ``hook.state_dict()``: the source's own state
    is loaded before the iterator opens (``load_state_dict``), or else the first
    ``consumed`` items of a fresh iterator are skipped (a deterministic stream)."""

    def __init__(self, source: Iterable[Any], *, rank: int, resume: dict[str, Any] | None = None) -> None:
        if isinstance(source, (str, bytes)) or not isinstance(source, Iterable):
            raise ValueError(
                f"hook.micro_batches expects an iterable of micro-batches (a DataLoader, an "
                f"IterableDataset, a StatefulDataLoader, an iterator), got {type(source).__name__}.")
        self.source = source
        self.rank = rank
        self.consumed = 0  # micro-batches trained from this stream (across resumes)
        self.pushback: deque[Any] = deque()  # taken from the iterator, not trained yet
        self.signature: Any = None
        self.last: Any = None  # the newest micro-batch trained: a drained rank's dummy
        self._it: Iterator[Any] | None = None
        self._resume = resume

    def _open(self) -> Iterator[Any]:
        if self._it is not None:
            return self._it
        resume, self._resume = self._resume, None
        if resume is None:
            self._it = iter(self.source)
            return self._it
        consumed = int(resume["consumed"])
        state = resume.get("source_state")
        if state is not None:
            loader = getattr(self.source, "load_state_dict", None)
            if loader is None:
                raise ValueError(
                    f"rank {self.rank}: the checkpoint holds the stream's own state_dict, but the "
                    f"source given now ({type(self.source).__name__}) has no load_state_dict(); pass "
                    "the same kind of source (a StatefulDataLoader, a datasets IterableDataset) as before.")
            loader(state)
            self._it = iter(self.source)
        else:  # a plain iterator: replay it up to where the run stood
            self._it = iter(self.source)
            skipped = sum(1 for _ in itertools.islice(self._it, consumed))
            if skipped < consumed:
                raise StreamEnded(
                    f"rank {self.rank}: resuming needs {consumed} micro-batches skipped from the stream, "
                    f"but it ended after {skipped}: resume with the same stream (same files, shard and order).")
        self.consumed = consumed
        self.pushback.extend(resume.get("pushback") or ())
        return self._it

    def take(self, n: int, *, step: int) -> list[Any]:
        """The next ``n`` micro-batches, all of one shape; StreamEnded before any is used if
        the stream has fewer left."""
        it = self._open()
        got: list[Any] = []
        while len(got) < n:
            if self.pushback:
                got.append(self.pushback.popleft())
                continue
            try:
                got.append(next(it))
            except StopIteration:
                self.pushback.extendleft(reversed(got))  # nothing of this step is lost
                raise StreamEnded(
                    f"rank {self.rank}'s stream ended at step {step}: its share is {n} micro-batches, the "
                    f"stream had {len(got)} left (after {self.consumed} trained). Give every rank a stream "
                    "that lasts the run (repeat it, or set the number of steps from the shortest shard); "
                    "a stream that ends stops this rank, and torchrun then stops the job.") from None
        for i, mb in enumerate(got):
            self._check_shape(mb, i, step)
        self.consumed += n
        if got:
            self.last = got[-1]
        return got

    def dummy(self, *, step: int) -> Any:
        """A micro-batch for a drained rank: its newest one, else one peeked and kept for later."""
        if self.last is None:
            it = self._open()
            if not self.pushback:
                try:
                    self.pushback.append(next(it))
                except StopIteration:
                    raise StreamEnded(
                        f"rank {self.rank} is drained at step {step} but its stream is empty: a drained "
                        "rank still runs one micro-batch with weight 0 (to join the gradient collective) "
                        "and needs one micro-batch to shape it.") from None
            self._check_shape(self.pushback[0], 0, step)
            return self.pushback[0]
        return self.last

    def _check_shape(self, mb: Any, i: int, step: int) -> None:
        sig = batch_signature(mb)
        if self.signature is None:
            self.signature = sig
        elif sig != self.signature:
            raise ValueError(
                f"rank {self.rank}, step {step}, micro-batch {i}: its shapes {_shapes(sig)} differ from the "
                f"first micro-batch's {_shapes(self.signature)}. Micro-batch placements need one fixed "
                "shape: pack or pad every micro-batch to it (drop_last=True on the loader).")

    def state_dict(self) -> dict[str, Any]:
        state = getattr(self.source, "state_dict", None)
        return {"consumed": self.consumed, "source_state": state() if callable(state) else None,
                "pushback": list(self.pushback)}


def _shapes(sig: Any) -> str:
    if sig[0] == "tensor":
        return f"{list(sig[1])} {sig[2].removeprefix('torch.')}"
    if sig[0] == "dict":
        return "{" + ", ".join(f"{k}: {_shapes(v)}" for k, v in sig[1]) + "}"
    if sig[0] == "leaf":
        return sig[1]
    return "(" + ", ".join(_shapes(v) for v in sig[1]) + ")"


class MicroBatches:
    """This step's micro-batches of one rank (``hook.micro_batches(source)``): iterate it
    once inside ``hook.step()``, one forward and backward per item. ``len()`` is the number
    trained (1 for a drained rank's dummy), ``count`` this rank's share, ``items`` the list."""

    def __init__(self, items: list[Any], count: int, set_sync: Callable[[bool], None],
                 after_last: Callable[[], None], abandon: Callable[[], None]) -> None:
        self.items = items
        self.count = count
        self._set_sync = set_sync
        self._after_last = after_last
        self._abandon = abandon
        self.started = False
        self.finished = False

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Any]:
        if self.started:
            raise RuntimeError("hook.micro_batches(...) of one step was iterated twice: iterate it once per step.")
        self.started = True
        return self._run()

    def _run(self) -> Iterator[Any]:
        n = len(self.items)
        try:
            for i, mb in enumerate(self.items):
                self._set_sync(i == n - 1)  # the forward and backward of mb run while suspended here
                yield mb
            self._after_last()
            self.finished = True
        finally:
            if not self.finished:  # left early (an exception, a break): sync back on
                self._abandon()

"""ControlChannel: rank 0 decides when a placement takes effect; every rank learns it.

Every ``exchange_every`` (K) steps all ranks launch an asynchronous broadcast from rank 0
of one int64 tensor ``[version, effective_batch, k, shares...]`` (k: the placement's
``length_sq_weight``, a float64's bits) on a CPU gloo group the hook
creates (so NCCL jobs pay no device sync), and collect it ``exchange_lag`` (L) steps
later. Rank 0 fills it with the newest pending placement and ``effective_batch = launch +
L + lookahead``: late enough that no rank has trained, nor any loader prefetched, that
batch under the old placement. Without a process group (one process) the same schedule
runs locally, so offline runs behave exactly like distributed ones.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from trainer_hook.placement import PlacementSchedule

__all__ = ["ControlChannel", "PendingPlacement"]


@dataclass(frozen=True, slots=True)
class PendingPlacement:
    """A validated placement waiting for rank 0's next exchange."""

    version: int
    shares: tuple[int, ...]
    reason: str = ""
    length_sq_weight: float = 0.0


class ControlChannel:
    """Runs the exchange schedule; call ``on_step(k)`` at the start of every step k."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        schedule: PlacementSchedule,
        exchange_every: int,
        exchange_lag: int,
        lookahead: int,
        group: Any = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.schedule = schedule
        self.every = exchange_every
        self.lag = exchange_lag
        self.lookahead = lookahead
        self.group = group
        self._lock = threading.Lock()
        self._pending: PendingPlacement | None = None
        self._inflight: tuple[int, Any, list[int] | None] | None = None
        # One buffer, reused: at most one exchange is in flight (lag < every), and
        # allocating a tensor per exchange costs more than the rest of the step hook.
        self._buf = torch.full((3 + world_size,), -1, dtype=torch.int64) if group is not None else None
        self._buf_dirty = False
        self._bcast: tuple[list[torch.Tensor], Any] | None = None
        if self._buf is not None:
            import torch.distributed as dist

            # The process group's own broadcast: dist.broadcast's Python wrapper costs as
            # much again as the launch itself (about 60 us a call on 2 CPU cores).
            opts = dist.BroadcastOptions()
            opts.rootRank = dist.get_group_rank(group, 0)
            opts.rootTensor = 0
            self._bcast = ([self._buf], opts)
        self.exchanges = 0
        # The first batch index at which on_step has anything to do (collect or launch);
        # every other step costs one integer compare. Batch indices never go back.
        self.due = 0
        # Before the first collection, the exchange launched at step 0 may start a
        # placement at lag + lookahead, so everything before it is final.
        schedule.settle(self.lag + self.lookahead - 1)

    def set_lookahead(self, start: int, lookahead: int) -> None:
        """Start at batch ``start`` with the agreed ``lookahead`` (before any exchange)."""
        self.lookahead = lookahead
        # The first exchange launches at the first multiple of ``every`` from ``start`` (a
        # resumed run may start off that grid) and is collected ``lag`` steps later; the loader
        # runs ``lookahead`` ahead of training meanwhile. That exchange cannot start a
        # placement before ``first + lag + lookahead``, so everything before is final.
        first = -(-start // self.every) * self.every
        self.schedule.restart_settled(first + self.lag + lookahead - 1)

    @property
    def pending(self) -> PendingPlacement | None:
        with self._lock:
            return self._pending

    @property
    def undelivered(self) -> PendingPlacement | None:
        """Rank 0: the newest placement offered but not scheduled yet (pending or in flight)."""
        with self._lock:
            pending = self._pending
        inflight = self._inflight[2] if self._inflight is not None else None
        if inflight is not None and (pending is None or inflight[0] > pending.version):
            return PendingPlacement(inflight[0], tuple(inflight[3:]), length_sq_weight=_float(inflight[2]))
        return pending

    def offer(self, placement: PendingPlacement) -> None:
        """Rank 0: queue a validated placement for the next exchange (newest wins)."""
        with self._lock:
            if self._pending is None or placement.version > self._pending.version:
                self._pending = placement

    def on_step(self, batch_index: int) -> None:
        """Collect an exchange that is due, then launch one if this is an exchange step."""
        if batch_index < self.due:
            return
        if self._inflight is not None and batch_index >= self._inflight[0] + self.lag:
            self._collect()
        if batch_index % self.every == 0 and self._inflight is None:
            self._launch(batch_index)
        inflight = self._inflight
        self.due = inflight[0] + self.lag if inflight is not None else (batch_index // self.every + 1) * self.every

    def _launch(self, step: int) -> None:
        pending = None
        if self.rank == 0:
            with self._lock:
                pending, self._pending = self._pending, None
        payload = None
        if pending is not None:
            payload = [pending.version, step + self.lag + self.lookahead, _bits(pending.length_sq_weight),
                       *pending.shares]
        buf, work = self._buf, None
        if buf is not None and self._bcast is not None:
            if self.rank == 0 and payload is not None:
                buf.copy_(torch.tensor(payload, dtype=torch.int64))
                self._buf_dirty = True
            elif self.rank == 0 and self._buf_dirty:
                buf.fill_(-1)
                self._buf_dirty = False
            work = self.group.broadcast(*self._bcast)  # async: collected L steps later
        self._inflight = (step, work, payload)
        self.exchanges += 1

    def _collect(self) -> None:
        assert self._inflight is not None
        step, work, payload = self._inflight
        self._inflight = None
        values: list[int]
        if work is not None and self._buf is not None:
            work.wait()  # launched L steps ago; normally complete already
            values = self._buf.tolist()
        else:
            values = payload if payload is not None else [-1]
        version = values[0]
        if version >= 0 and version > self.schedule.latest.version:
            self.schedule.add(values[1], version, values[3:], length_sq_weight=_float(values[2]))
        self.schedule.settle(step + self.every + self.lag + self.lookahead - 1)

    def sync_initial(self, version: int | None, shares: list[int] | None,
                     length_sq_weight: float = 0.0) -> tuple[int, list[int]] | None:
        """Start-up: rank 0's placement in force reaches every rank before any batch.

        A blocking broadcast, done once. Returns the placement applied, or None when rank
        0 had none (the job starts at version 0).
        """
        buf = torch.full((2 + self.world_size,), -1, dtype=torch.int64)
        if self.rank == 0 and version is not None and shares is not None:
            buf[0] = version
            buf[1] = _bits(length_sq_weight)
            buf[2:] = torch.tensor(shares, dtype=torch.int64)
        if self.group is not None:
            import torch.distributed as dist

            dist.broadcast(buf, src=0, group=self.group)
        values = buf.tolist()
        if values[0] < 0:
            return None
        self.schedule.replace_initial(values[0], values[2:], length_sq_weight=_float(values[1]))
        return values[0], values[2:]

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for an exchange still in flight (every rank launched it) and drop it.

        ``timeout_s``: give up waiting after that long (gloo raises; the error propagates).
        """
        inflight, self._inflight = self._inflight, None
        self.due = 0
        if inflight is not None and inflight[1] is not None:
            if timeout_s is None:
                inflight[1].wait()
            else:
                inflight[1].wait(timedelta(seconds=timeout_s))

    def after_fork_in_child(self) -> None:
        """A forked child: fresh lock, and the gloo group and work are dropped untouched."""
        self._lock = threading.Lock()
        self._inflight = None
        self._bcast = None
        self.group = None


def _bits(x: float) -> int:
    """A float64's bits as an int64 (the exchange carries int64s only)."""
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


def _float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", int(bits)))[0])

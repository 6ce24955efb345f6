"""Live per-job, per-rank state: ring buffers of what the hooks sent, and derived numbers.

Writes come from the ingest handler (one call per websocket message, never per record);
reads take a consistent snapshot under one lock, so the Prometheus collector, REST routes
and the controller may read from any thread.

Derived numbers use each rank's last ``window_steps`` steps:
- ``compute_ms``, ``step_ms`` ...: means over that window.
- ``step_rate_hz``: steps per second over that window (from the records' ``t``).
- job ``imbalance``: ``max_i compute_i / mean_i compute_i - 1`` over ranks with data
  (0 = perfectly balanced; 1.0 = the slowest rank computes twice as long as the average).
- job ``idle_fraction``: ``1 - mean_i compute_i / max_i compute_i``, the share of paid
  accelerator time spent waiting for the slowest rank.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from operator import attrgetter

from trainer_hook.protocol import DeviceSample, Hello, Metrics, StepRecord

__all__ = ["LiveState", "RankView", "JobView", "Window", "eta_seconds"]


@dataclass(slots=True)
class _Rank:
    hello: Hello
    steps: deque[StepRecord]
    device: deque[DeviceSample]
    connected: bool = True
    first_seen: float = 0.0
    last_seen: float = 0.0
    dropped: int = 0
    messages: int = 0
    # Records since the last persistence flush (swapped out whole by drain_windows).
    pending: list[StepRecord] = field(default_factory=list)
    pending_device: list[DeviceSample] = field(default_factory=list)
    pending_dropped: int = 0
    # Bumped on every change; views of unchanged ranks are reused (1,024 ranks at 10 Hz).
    rev: int = 0
    cached: tuple[int, RankView] | None = None


@dataclass(slots=True)
class _Job:
    job: str
    world_size: int
    global_batch_size: int
    created_at: float
    last_seen: float
    ranks: dict[int, _Rank] = field(default_factory=dict)
    total_steps: int | None = None  # the newest a hook said (hello or metrics)


@dataclass(frozen=True, slots=True)
class RankView:
    """A snapshot of one rank with its derived numbers (None until it has sent a step)."""

    rank: int
    host: str
    device_type: str
    device_name: str
    mem_total_bytes: int | None
    connected: bool
    first_seen: float
    last_seen: float
    batch_index: int | None
    placement_version: int | None
    local_batch_size: int | None
    compute_ms: float | None
    sync_wait_ms: float | None
    data_wait_ms: float | None
    optimizer_ms: float | None
    step_ms: float | None
    step_rate_hz: float | None
    n_steps: int
    dropped: int
    device: DeviceSample | None


@dataclass(frozen=True, slots=True)
class JobView:
    job: str
    world_size: int
    global_batch_size: int
    created_at: float
    last_seen: float
    connected_ranks: int
    batch_index: int | None
    step_ms: float | None
    step_rate_hz: float | None
    imbalance: float | None
    idle_fraction: float | None
    ranks: tuple[RankView, ...]
    total_steps: int | None = None

    @property
    def eta_s(self) -> float | None:
        """Seconds to finish: steps left times the recent step time (None if unknown)."""
        return eta_seconds(self.total_steps, self.batch_index, self.step_ms)


@dataclass(frozen=True, slots=True)
class Window:
    """Aggregate of one rank's steps between two persistence flushes."""

    job: str
    rank: int
    t_start: float
    t_end: float
    batch_index_start: int
    batch_index_end: int
    n_steps: int
    placement_version: int
    local_batch_size: float
    compute_ms: float
    sync_wait_ms: float
    data_wait_ms: float
    optimizer_ms: float
    step_ms: float
    dropped: int
    device: DeviceSample | None


_TIMES = attrgetter("compute_ms", "sync_wait_ms", "data_wait_ms", "optimizer_ms", "step_ms")


def eta_seconds(total_steps: int | None, batch_index: int | None, step_ms: float | None) -> float | None:
    """Steps left after ``batch_index`` (0-based, trained) times ``step_ms``, in seconds."""
    if total_steps is None or not step_ms:
        return None
    done = batch_index + 1 if batch_index is not None else 0
    return max(total_steps - done, 0) * step_ms / 1000.0


def _mean(vals: list[float]) -> float:
    return sum(vals) / len(vals)


class LiveState:
    """In-memory state of every job the backend has heard from since it started."""

    def __init__(self, *, step_buffer: int = 2048, device_buffer: int = 600, window_steps: int = 20):
        self.step_buffer = step_buffer
        self.device_buffer = device_buffer
        self.window_steps = window_steps
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self.messages_total = 0
        self.records_total = 0
        self.dropped_total = 0

    # --- writes (ingest) ----------------------------------------------------------------

    def register(self, hello: Hello, now: float | None = None) -> bool:
        """Record a rank's hello; returns True when this starts a new run of the job
        (first sight, or world size / global batch size changed, which resets its ranks)."""
        now = time.time() if now is None else now
        with self._lock:
            job = self._jobs.get(hello.job)
            new_run = (
                job is None
                or job.world_size != hello.world_size
                or job.global_batch_size != hello.global_batch_size
            )
            if new_run:
                job = _Job(hello.job, hello.world_size, hello.global_batch_size, now, now)
                self._jobs[hello.job] = job
            assert job is not None
            job.last_seen = now
            if hello.total_steps is not None:
                job.total_steps = hello.total_steps
            old = job.ranks.get(hello.rank)
            if old is None:
                job.ranks[hello.rank] = _Rank(
                    hello=hello, steps=deque(maxlen=self.step_buffer),
                    device=deque(maxlen=self.device_buffer), first_seen=now, last_seen=now,
                )
            else:  # a reconnect keeps the history in the buffers
                old.hello, old.connected, old.last_seen = hello, True, now
                old.rev += 1
            return new_run

    def add_metrics(self, msg: Metrics, now: float | None = None) -> None:
        """Append one metrics message of a registered rank (unknown ranks raise KeyError)."""
        now = time.time() if now is None else now
        with self._lock:
            job = self._jobs[msg.job]
            r = job.ranks[msg.rank]
            r.steps.extend(msg.steps)
            r.device.extend(msg.device)
            r.pending.extend(msg.steps)
            r.pending_device.extend(msg.device)
            r.dropped += msg.dropped
            r.pending_dropped += msg.dropped
            if msg.total_steps is not None:
                job.total_steps = msg.total_steps
            r.messages += 1
            r.rev += 1
            r.last_seen = job.last_seen = now
            self.messages_total += 1
            self.records_total += len(msg.steps) + len(msg.device)
            self.dropped_total += msg.dropped

    def set_connected(self, job: str, rank: int, connected: bool) -> None:
        with self._lock:
            j = self._jobs.get(job)
            if j is not None and rank in j.ranks:
                j.ranks[rank].connected = connected
                j.ranks[rank].rev += 1

    def forget(self, job: str) -> None:
        with self._lock:
            self._jobs.pop(job, None)

    # --- reads ----------------------------------------------------------------------------

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)

    def __contains__(self, job: object) -> bool:
        with self._lock:
            return job in self._jobs

    def hello(self, job: str, rank: int) -> Hello | None:
        with self._lock:
            j = self._jobs.get(job)
            r = j.ranks.get(rank) if j else None
            return r.hello if r else None

    def view(self, job: str) -> JobView | None:
        """A consistent snapshot of one job with derived numbers, or None if unknown."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return None
            ranks = tuple(self._rank_view(rank, r) for rank, r in sorted(j.ranks.items()))
            meta = (j.job, j.world_size, j.global_batch_size, j.created_at, j.last_seen)
            total_steps = j.total_steps
        with_data = [r for r in ranks if r.compute_ms is not None]
        compute = [r.compute_ms for r in with_data if r.compute_ms is not None]
        imbalance = idle = None
        if compute and max(compute) > 0:
            mean_c = _mean(compute)
            imbalance = max(compute) / mean_c - 1.0 if mean_c > 0 else None
            idle = 1.0 - mean_c / max(compute)
        step_ms = [r.step_ms for r in with_data if r.step_ms is not None]
        rates = [r.step_rate_hz for r in with_data if r.step_rate_hz is not None]
        idx = [r.batch_index for r in with_data if r.batch_index is not None]
        return JobView(
            job=meta[0], world_size=meta[1], global_batch_size=meta[2], created_at=meta[3],
            last_seen=meta[4], connected_ranks=sum(r.connected for r in ranks),
            batch_index=max(idx) if idx else None,
            step_ms=statistics.median(step_ms) if step_ms else None,
            step_rate_hz=_mean(rates) if rates else None,
            imbalance=imbalance, idle_fraction=idle, ranks=ranks, total_steps=total_steps,
        )

    def _rank_view(self, rank: int, r: _Rank) -> RankView:
        if r.cached is not None and r.cached[0] == r.rev:
            return r.cached[1]
        n = min(self.window_steps, len(r.steps))
        win = list(islice(reversed(r.steps), n))  # newest first
        last = win[0] if win else None
        rate = None
        if n >= 2 and win[0].t > win[-1].t:
            rate = (n - 1) / (win[0].t - win[-1].t)
        # Means oldest first, as before: the same float sums whatever the ring's layout.
        win.reverse()
        means: list[float | None] = [sum(c) / n for c in zip(*map(_TIMES, win), strict=True)] if n else [None] * 5
        h = r.hello
        view = RankView(
            rank=rank, host=h.host, device_type=h.device_type, device_name=h.device_name,
            mem_total_bytes=h.mem_total_bytes, connected=r.connected, first_seen=r.first_seen,
            last_seen=r.last_seen,
            batch_index=last.batch_index if last else None,
            placement_version=last.placement_version if last else None,
            local_batch_size=last.local_batch_size if last else None,
            compute_ms=means[0],
            sync_wait_ms=means[1],
            data_wait_ms=means[2],
            optimizer_ms=means[3],
            step_ms=means[4],
            step_rate_hz=rate, n_steps=len(r.steps), dropped=r.dropped,
            device=r.device[-1] if r.device else None,
        )
        r.cached = (r.rev, view)
        return view

    def recent_steps(self, job: str, rank: int, n: int | None = None) -> tuple[StepRecord, ...]:
        """The last ``n`` (default: all buffered) step records of a rank, oldest first."""
        with self._lock:
            j = self._jobs.get(job)
            r = j.ranks.get(rank) if j else None
            if r is None:
                return ()
            if n is None or n >= len(r.steps):
                return tuple(r.steps)
            if n <= 0:
                return ()
            tail = list(islice(reversed(r.steps), n))  # O(n) from the newest end
        tail.reverse()
        return tuple(tail)

    def steps_after(self, job: str, after: dict[int, tuple[int, int]]) -> dict[int, list[StepRecord]]:
        """For each ``rank: (batch_index, n)`` in ``after``: those of the rank's newest ``n``
        step records whose batch index is above ``batch_index``, oldest first. One lock for
        all ranks (the dashboard reads ~1,000 ranks per tick)."""
        out: dict[int, list[StepRecord]] = {}
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return out
            for rank, (last, n) in after.items():
                r = j.ranks.get(rank)
                if r is None:
                    continue
                recs = [s for s in islice(reversed(r.steps), n) if s.batch_index > last]
                recs.reverse()
                out[rank] = recs
        return out

    def recent_device(self, job: str, rank: int, n: int | None = None) -> tuple[DeviceSample, ...]:
        """The last ``n`` (default: all buffered) device samples of a rank, oldest first."""
        with self._lock:
            j = self._jobs.get(job)
            r = j.ranks.get(rank) if j else None
            if r is None:
                return ()
            if n is not None and 0 < n < len(r.device):  # copy only the tail
                return tuple(islice(r.device, len(r.device) - n, None))
            items = tuple(r.device)
        return items if n is None else items[-n:]

    def steps(
        self, job: str, *, ranks: set[int] | None = None, batch_from: int | None = None,
        batch_to: int | None = None, limit: int = 10_000,
    ) -> list[tuple[int, StepRecord]]:
        """Buffered step records filtered by rank and inclusive batch-index range,
        ordered by (batch_index, rank); the newest ``limit`` are kept."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return []
            picked = [
                (rank, s) for rank, r in j.ranks.items() if ranks is None or rank in ranks
                for s in r.steps
                if (batch_from is None or s.batch_index >= batch_from)
                and (batch_to is None or s.batch_index <= batch_to)
            ]
        picked.sort(key=lambda p: (p[1].batch_index, p[0]))
        return picked[-limit:] if limit else []

    # --- persistence --------------------------------------------------------------------

    def drain_windows(self) -> list[Window]:
        """Aggregate and clear what each rank sent since the previous call."""
        taken: list[tuple[str, int, list[StepRecord], list[DeviceSample], int]] = []
        with self._lock:
            for j in self._jobs.values():
                for rank, r in j.ranks.items():
                    if r.pending:
                        taken.append((j.job, rank, r.pending, r.pending_device, r.pending_dropped))
                        r.pending, r.pending_device, r.pending_dropped = [], [], 0
                    elif r.pending_device:  # no steps yet: keep the newest reading (and drops) for later
                        r.pending_device = r.pending_device[-1:]
        out = []
        for job, rank, steps, device, dropped in taken:
            n = len(steps)
            out.append(Window(
                job=job, rank=rank, t_start=steps[0].t, t_end=steps[-1].t,
                batch_index_start=min(s.batch_index for s in steps),
                batch_index_end=max(s.batch_index for s in steps), n_steps=n,
                placement_version=steps[-1].placement_version,
                local_batch_size=sum(s.local_batch_size for s in steps) / n,
                compute_ms=sum(s.compute_ms for s in steps) / n,
                sync_wait_ms=sum(s.sync_wait_ms for s in steps) / n,
                data_wait_ms=sum(s.data_wait_ms for s in steps) / n,
                optimizer_ms=sum(s.optimizer_ms for s in steps) / n,
                step_ms=sum(s.step_ms for s in steps) / n,
                dropped=dropped, device=device[-1] if device else None,
            ))
        return out

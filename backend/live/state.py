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

The ring buffers hold plain tuples of numbers and strings, not ``StepRecord`` /
``DeviceSample`` objects: the cyclic garbage collector stops tracking such tuples, so two
million buffered steps (1,024 ranks) cost a full collection nothing. As objects they made
every full collection walk them all, stopping every thread for 0.4 s and more (1,024
ranks, 30 s in; seconds once the buffers are full). Readers get objects back
(``recent_steps``, ``steps``, ``recent_device``) or the rows themselves (``*_rows``, with
the ``STEP_*`` indices) where they read many.
"""

from __future__ import annotations

import statistics
import threading
import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field, replace
from itertools import islice
from operator import attrgetter
from typing import Any, Final

from backend.metrics_contract import STEP_BUCKETS_S
from backend.policy.comm import CommStep, Communication, assess
from backend.policy.memory import MemoryFit, MemoryReading, RankMemory, fit_memory
from trainer_hook.protocol import (
    LINK_FIELDS,
    STEP_FIELDS,
    STEP_TIMES,
    DeviceSample,
    Hello,
    Metrics,
    StepRecord,
)

__all__ = ["LiveState", "RankView", "JobView", "Window", "eta_seconds", "STEP_FIELDS",
           "DEVICE_FIELDS", "STEP_BATCH", "STEP_LOCAL_BATCH", "STEP_VERSION", "STEP_COMPUTE",
           "STEP_MS", "STEP_T", "StepRow", "DeviceRow"]

# A buffered step is a plain tuple in the protocol's ``STEP_FIELDS`` order; these index it
# (literals, so that type checkers know each column's type; tests/test_record_shape.py
# holds them to ``STEP_FIELDS``).
STEP_BATCH: Final = 0
STEP_LOCAL_BATCH: Final = 1
STEP_VERSION: Final = 2
STEP_COMPUTE: Final = 4
STEP_MS: Final = 7
STEP_T: Final = 8
DEVICE_FIELDS = ("t", "source", "util_pct", "mem_used_bytes", "mem_total_bytes", "power_w",
                 "temp_c", "sm_clock_mhz", "sm_clock_max_mhz", "throttle_reasons", "cpu_pct",
                 "rss_bytes", *LINK_FIELDS)
StepRow = tuple[int, int, int, float, float, float, float, float, float]  # STEP_FIELDS
DeviceRow = tuple[Any, ...]  # DEVICE_FIELDS, throttle_reasons as a tuple
_step_row = attrgetter(*STEP_FIELDS)
_device_attrs = attrgetter(*DEVICE_FIELDS)


def _device_row(d: DeviceSample) -> DeviceRow:
    row = _device_attrs(d)
    return (*row[:9], tuple(row[9]), *row[10:])


def _step(row: StepRow) -> StepRecord:
    fields: dict[str, Any] = dict(zip(STEP_FIELDS, row, strict=True))
    return StepRecord(**fields)


def _device(row: DeviceRow) -> DeviceSample:
    return DeviceSample(t=row[0], source=row[1], util_pct=row[2], mem_used_bytes=row[3],
                        mem_total_bytes=row[4], power_w=row[5], temp_c=row[6], sm_clock_mhz=row[7],
                        sm_clock_max_mhz=row[8], throttle_reasons=list(row[9]), cpu_pct=row[10],
                        rss_bytes=row[11], **dict(zip(LINK_FIELDS, row[12:], strict=True)))


@dataclass(slots=True)
class _Rank:
    hello: Hello
    steps: deque[StepRow]
    device: deque[DeviceRow]
    connected: bool = True
    lost: bool = False  # its connection dropped without a close (the process died?)
    goodbye: bool = False  # closed its connection normally (the hook's close()) since its hello
    first_seen: float = 0.0
    last_seen: float = 0.0
    dropped: int = 0
    messages: int = 0
    # Records since the last persistence flush (swapped out whole by drain_windows).
    pending: list[StepRow] = field(default_factory=list)
    pending_device: list[DeviceRow] = field(default_factory=list)
    pending_dropped: int = 0
    # (comm_bytes, comm_ms) of the pending steps that carried communication counters.
    pending_comm: list[tuple[int, float | None]] = field(default_factory=list)
    # Bumped on every change; views of unchanged ranks are reused (1,024 ranks at 10 Hz).
    rev: int = 0
    cached: tuple[int, RankView] | None = None
    # The newest device sample and the memory summary as objects, built on first read.
    device_obj: DeviceSample | None = None
    memory_obj: RankMemory | None = None
    # Peak-memory readings (the step records that carry one) and their fit, refitted only
    # when a reading arrives.
    memory: deque[MemoryReading] = field(default_factory=lambda: deque(maxlen=_MEMORY_READINGS))
    mem_fit: MemoryFit | None = None
    mem_stale: bool = False
    # (batch_index, work, batch_work, work_sq, batch_work_sq) of steps with a cost (sq: lengths).
    work: deque[tuple[int, float, float, float | None, float | None]] = field(default_factory=lambda: deque(maxlen=_WORK_ROWS))
    # (batch_index, comm_bytes, comm_ms) of the steps that carried communication counters.
    comm: deque[tuple[int, int, float | None]] = field(default_factory=lambda: deque(maxlen=_COMM_READINGS))


@dataclass(slots=True)
class _Job:
    job: str
    world_size: int
    global_batch_size: int
    created_at: float
    last_seen: float
    ranks: dict[int, _Rank] = field(default_factory=dict)
    total_steps: int | None = None  # the newest a hook said (hello or metrics)
    left_at: float = 0.0  # when its last connected rank went away
    # Step wall times as rank 0 sent them (every rank of a synchronous job sees the same
    # step): counts per STEP_BUCKETS_S bucket, the last one +Inf, and their sum in seconds.
    step_buckets: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS_S) + 1))
    step_sum_s: float = 0.0
    # The newest ``communication`` answer and the ranks' revisions it was computed at.
    comm_cached: tuple[tuple[int, ...], Communication] | None = None


@dataclass(slots=True)
class RankView:
    """A snapshot of one rank with its derived numbers (None until it has sent a step).

    Read-only by contract (views are cached and shared between readers); not ``frozen``
    because a frozen dataclass's ``__init__`` sets each of its 26 fields through
    ``object.__setattr__``: 4x the cost, paid ~4,000 times a second at 2,048 ranks."""

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
    lost: bool = False  # its socket dropped without a close and it has not come back
    # Peak device memory: how the rank measures it, the fit of its readings and the
    # newest reading (None where the rank sends none).
    memory: RankMemory | None = None
    mem_peak_bytes: int | None = None
    gpu_index: int | None = None
    gpu_uuid: str = ""
    # With a per-sample cost (tokens, say): work per second of compute over the recent
    # steps, and the mean fraction of each global batch's work the rank trained.
    work_per_s: float | None = None
    work_share: float | None = None


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
    lost_ranks: tuple[int, ...] = ()  # ranks whose socket dropped without a close

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
    # Means over the window's steps that carried communication counters (None: none did;
    # absent counters are stored as absent, never as 0).
    comm_bytes: float | None = None
    comm_ms: float | None = None


_TIME_COLUMNS = tuple(STEP_FIELDS.index(f) for f in STEP_TIMES)


def eta_seconds(total_steps: int | None, batch_index: int | None, step_ms: float | None) -> float | None:
    """Steps left after ``batch_index`` (0-based, trained) times ``step_ms``, in seconds."""
    if total_steps is None or not step_ms:
        return None
    done = batch_index + 1 if batch_index is not None else 0
    return max(total_steps - done, 0) * step_ms / 1000.0


_MEMORY_READINGS = 256  # peak-memory readings kept per rank (one every few steps)
_WORK_ROWS = 512  # work rows kept per rank: more than a policy window
_COMM_READINGS = 256  # steps with communication counters kept per rank


def _work_rates(work: deque[tuple[int, float, float, float | None, float | None]], win: list[StepRow]) -> tuple[float | None, float | None]:
    """(work per second of compute, mean work share) over the window's steps that carry work."""
    compute = {row[STEP_BATCH]: row[STEP_COMPUTE] for row in win}
    done = ms = share = 0.0
    n = 0
    for k, w, bw, *_ in work:
        c = compute.get(k)
        if c is None:
            continue
        done += w
        ms += c
        share += w / bw if bw > 0 else 0.0
        n += 1
    if n == 0:
        return None, None
    return (done / (ms / 1000.0) if ms > 0 else None), share / n


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
                old.hello, old.connected, old.lost, old.last_seen = hello, True, False, now
                old.goodbye, old.memory_obj = False, None
                old.rev += 1
            return new_run

    def add_metrics(self, msg: Metrics, now: float | None = None) -> None:
        """Append one metrics message of a registered rank (unknown ranks raise KeyError)."""
        now = time.time() if now is None else now
        with self._lock:
            job = self._jobs[msg.job]
            r = job.ranks[msg.rank]
            rows = list(map(_step_row, msg.steps))
            for s in msg.steps:
                if s.work is not None and s.batch_work is not None:
                    r.work.append((s.batch_index, s.work, s.batch_work, s.work_sq, s.batch_work_sq))
                if s.comm_bytes is not None:
                    r.comm.append((s.batch_index, s.comm_bytes, s.comm_ms))
                    r.pending_comm.append((s.comm_bytes, s.comm_ms))
                if s.mem_peak_bytes is not None:
                    r.memory.append(MemoryReading(s.local_batch_size, s.mem_peak_bytes,
                                                  s.mem_total_bytes, s.mem_reserved_bytes))
                    r.mem_stale, r.memory_obj = True, None
            if msg.rank == 0:
                buckets = job.step_buckets
                for row in rows:
                    step_s = row[STEP_MS] / 1000.0
                    buckets[bisect_left(STEP_BUCKETS_S, step_s)] += 1
                    job.step_sum_s += step_s
            r.steps.extend(rows)
            r.pending.extend(rows)
            if msg.device:
                dev = list(map(_device_row, msg.device))
                r.device.extend(dev)
                r.device_obj = None
                r.pending_device.extend(dev)
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

    def set_connected(self, job: str, rank: int, connected: bool, *, lost: bool = False) -> None:
        """Mark a rank (dis)connected; ``lost`` when its connection dropped without a close."""
        with self._lock:
            j = self._jobs.get(job)
            if j is not None and rank in j.ranks:
                r = j.ranks[rank]
                r.connected, r.lost = connected, lost and not connected
                r.rev += 1
                if not connected and not any(x.connected for x in j.ranks.values()):
                    j.left_at = time.time()

    def idle_jobs(self, idle_s: float, now: float | None = None) -> list[str]:
        """Jobs with no connected rank, nothing left to persist, and no message or connected
        rank for ``idle_s`` seconds; the longest idle first (they may leave memory)."""
        now = time.time() if now is None else now
        with self._lock:
            idle = [(max(j.last_seen, j.left_at), name) for name, j in self._jobs.items()
                    if not any(r.connected or r.pending for r in j.ranks.values())]
        return [name for at, name in sorted(idle) if now - at >= idle_s]

    def job_count(self) -> int:
        with self._lock:
            return len(self._jobs)

    def shape(self, job: str) -> tuple[int, int] | None:
        """(world_size, global_batch_size) of a live job, None if unknown."""
        with self._lock:
            j = self._jobs.get(job)
            return (j.world_size, j.global_batch_size) if j is not None else None

    def said_goodbye(self, job: str, rank: int) -> bool:
        """Mark the rank as gone for good (a normal close); True when with it every rank of
        the job has said goodbye: the run ended."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None or rank not in j.ranks:
                return False
            r = j.ranks[rank]
            r.goodbye, r.connected = True, False
            r.rev += 1
            return len(j.ranks) == j.world_size and all(x.goodbye for x in j.ranks.values())

    def ended(self, job: str) -> bool:
        """True when every rank of ``job`` has said goodbye since its hello: the run ended, and
        nothing sent to it would take effect (a new hello makes it live again)."""
        with self._lock:
            j = self._jobs.get(job)
            return (j is not None and len(j.ranks) == j.world_size
                    and all(x.goodbye for x in j.ranks.values()))

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

    def rank_memory(self, job: str, rank: int) -> RankMemory | None:
        """What the policy knows of a rank's memory (``backend.policy.memory``): how the
        hook measures it, the fit of its readings, the device's total; None if unknown."""
        with self._lock:
            j = self._jobs.get(job)
            r = j.ranks.get(rank) if j else None
            return self._memory_of(r) if r is not None else None

    @staticmethod
    def _memory_of(r: _Rank) -> RankMemory:
        # Under the lock. One fit per rank per new reading, whoever asks first.
        if r.memory_obj is not None:
            return r.memory_obj
        if r.mem_stale:
            r.mem_fit, r.mem_stale = fit_memory(r.memory), False
        fit, hello = r.mem_fit, r.hello
        last_total = r.memory[-1].total_bytes if r.memory else None
        total = last_total or (fit.total_bytes if fit else None) or \
            (hello.mem_total_bytes if hello.memory_source else None)
        r.memory_obj = RankMemory(source=hello.memory_source, fit=fit, total_bytes=total)
        return r.memory_obj

    def memory_readings(self, job: str, rank: int) -> tuple[MemoryReading, ...]:
        """The rank's buffered peak-memory readings, oldest first."""
        with self._lock:
            j = self._jobs.get(job)
            r = j.ranks.get(rank) if j else None
            return tuple(r.memory) if r else ()
    def step_histogram(self, job: str) -> tuple[tuple[int, ...], float] | None:
        """The job's step-time histogram: cumulative counts per ``STEP_BUCKETS_S`` bound
        then +Inf, and the sum of the steps in seconds (None if the job is unknown)."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return None
            counts, total = list(j.step_buckets), j.step_sum_s
        running, cumulative = 0, []
        for c in counts:
            running += c
            cumulative.append(running)
        return tuple(cumulative), total

    def communication(self, job: str) -> Communication | None:
        """The job's communication and what bounds its step over the newest
        ``window_steps`` steps (``backend.policy.comm.assess``); None if the job is unknown."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return None
            key = tuple(r.rev for _, r in sorted(j.ranks.items()))
            cached = j.comm_cached
            if cached is not None and cached[0] == key:
                return cached[1]
            n = self.window_steps
            kind = next((r.hello.comm_kind for r in j.ranks.values() if r.hello.comm_kind), "")
            taken = {rank: (list(islice(reversed(r.steps), n)), list(islice(reversed(r.comm), 2 * n)))
                     for rank, r in j.ranks.items()}
            world = j.world_size
        steps: dict[int, list[CommStep]] = {}
        for rank, (rows, comm) in taken.items():
            by_k = {c[0]: c for c in comm}
            out = []
            for row in reversed(rows):
                c = by_k.get(row[STEP_BATCH])
                out.append(CommStep(row[STEP_BATCH], row[4], row[5], row[3], row[STEP_MS],
                                    c[1] if c else None, c[2] if c else None))
            steps[rank] = out
        result = assess(kind, world, steps, window=n)
        with self._lock:
            j = self._jobs.get(job)
            if j is not None:
                j.comm_cached = (key, result)
        return result

    def view(self, job: str) -> JobView | None:
        """A consistent snapshot of one job with derived numbers, or None if unknown."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return None
            views = []
            for rank, r in sorted(j.ranks.items()):  # unchanged ranks: their cached view
                c = r.cached
                views.append(c[1] if c is not None and c[0] == r.rev else self._rank_view(rank, r))
            ranks = tuple(views)
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
            lost_ranks=tuple(r.rank for r in ranks if r.lost),
        )

    def _rank_view(self, rank: int, r: _Rank) -> RankView:
        """The rank's view, built afresh (callers reuse ``r.cached`` while ``r.rev`` holds)."""
        ring = r.steps
        n = min(self.window_steps, len(ring))
        last = ring[-1] if n else None
        rate = None
        if last is not None and n >= 2 and last[STEP_T] > (t0 := ring[-n][STEP_T]):
            rate = (n - 1) / (last[STEP_T] - t0)
        # Means oldest first: the same float sums whatever the ring's layout.
        means: list[float | None] = [None] * len(STEP_TIMES)
        win: list[StepRow] = []
        if n:
            win = list(islice(reversed(ring), n))
            win.reverse()
            cols = list(zip(*win, strict=True))
            means = [sum(cols[i]) / n for i in _TIME_COLUMNS]
        if r.device_obj is None and r.device:
            r.device_obj = _device(r.device[-1])
        h = r.hello
        view = RankView(
            rank=rank, host=h.host, device_type=h.device_type, device_name=h.device_name,
            mem_total_bytes=h.mem_total_bytes, connected=r.connected, first_seen=r.first_seen,
            last_seen=r.last_seen,
            batch_index=last[STEP_BATCH] if last is not None else None,
            placement_version=last[STEP_VERSION] if last is not None else None,
            local_batch_size=last[STEP_LOCAL_BATCH] if last is not None else None,
            **dict(zip(STEP_TIMES, means, strict=True)),
            step_rate_hz=rate, n_steps=len(r.steps), dropped=r.dropped,
            device=r.device_obj, lost=r.lost,
            memory=self._memory_of(r), mem_peak_bytes=r.memory[-1].peak_bytes if r.memory else None,
            gpu_index=h.gpu_index, gpu_uuid=h.gpu_uuid,
        )
        if r.work and win:
            work_per_s, work_share = _work_rates(r.work, win)
            view = replace(view, work_per_s=work_per_s, work_share=work_share)
        r.cached = (r.rev, view)
        return view

    def recent_steps(self, job: str, rank: int, n: int | None = None) -> tuple[StepRecord, ...]:
        """The last ``n`` (default: all buffered) step records of a rank, oldest first."""
        return tuple(map(_step, self.recent_step_rows(job, rank, n)))

    def recent_step_rows(self, job: str, rank: int, n: int | None = None) -> tuple[StepRow, ...]:
        """``recent_steps`` as rows in ``STEP_FIELDS`` order (no objects built)."""
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

    def work_by_batch(self, job: str, rank: int) -> dict[int, tuple[float, float, float | None, float | None]]:
        """``batch_index -> (work, batch_work, work_sq, batch_work_sq)`` for the recent steps of
        ``rank`` that carry a cost (empty without one; squared lengths None without lengths)."""
        with self._lock:
            j = self._jobs.get(job)
            r = j.ranks.get(rank) if j else None
            if r is None:
                return {}
            return {w[0]: w[1:] for w in r.work}

    def recent_work_rows(self, job: str, rank: int, n: int) -> tuple[StepRow, ...]:
        """The newest ``n`` step rows in which ``rank`` had samples (local batch > 0), oldest
        first: a rank idle at share 0 keeps its last measured steps while the buffer holds
        them."""
        if n <= 0:
            return ()
        with self._lock:
            j = self._jobs.get(job)
            r = j.ranks.get(rank) if j else None
            if r is None:
                return ()
            tail = list(islice((s for s in reversed(r.steps) if s[STEP_LOCAL_BATCH] > 0), n))
        tail.reverse()
        return tuple(tail)

    def steps_after(self, job: str, after: dict[int, tuple[int, int]]) -> dict[int, list[StepRow]]:
        """For each ``rank: (batch_index, n)`` in ``after``: those of the rank's newest ``n``
        step rows (``STEP_FIELDS`` order) whose batch index is above ``batch_index``, oldest
        first. One lock for all ranks (the dashboard reads ~1,000 ranks per tick)."""
        out: dict[int, list[StepRow]] = {}
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return out
            for rank, (last, n) in after.items():
                r = j.ranks.get(rank)
                if r is None:
                    continue
                recs = [s for s in islice(reversed(r.steps), n) if s[STEP_BATCH] > last]
                recs.reverse()
                out[rank] = recs
        return out

    def recent_device(self, job: str, rank: int, n: int | None = None) -> tuple[DeviceSample, ...]:
        """The last ``n`` (default: all buffered) device samples of a rank, oldest first."""
        return tuple(map(_device, self.recent_device_rows(job, rank, n)))

    def recent_device_rows(self, job: str, rank: int, n: int | None = None) -> tuple[DeviceRow, ...]:
        """``recent_device`` as rows in ``DEVICE_FIELDS`` order (no objects built)."""
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
                if (batch_from is None or s[STEP_BATCH] >= batch_from)
                and (batch_to is None or s[STEP_BATCH] <= batch_to)
            ]
        picked.sort(key=lambda p: (p[1][STEP_BATCH], p[0]))
        return [(rank, _step(s)) for rank, s in picked[-limit:]] if limit else []

    # --- persistence --------------------------------------------------------------------

    def drain_windows(self) -> list[Window]:
        """Aggregate and clear what each rank sent since the previous call."""
        return aggregate_windows(self.take_pending())

    def take_pending(self) -> list[Pending]:
        """Clear and return what each rank sent since the previous call (cheap: the lists
        are swapped out; ``aggregate_windows`` does the work, on another thread if need be)."""
        taken: list[Pending] = []
        with self._lock:
            for j in self._jobs.values():
                for rank, r in j.ranks.items():
                    if r.pending:
                        taken.append((j.job, rank, r.pending, r.pending_device, r.pending_dropped,
                                      r.pending_comm))
                        r.pending, r.pending_device, r.pending_dropped, r.pending_comm = [], [], 0, []
                    elif r.pending_device:  # no steps yet: keep the newest reading (and drops) for later
                        r.pending_device = r.pending_device[-1:]
        return taken


# What one rank sent since the last persistence flush: (job, rank, steps, device, dropped,
# (comm_bytes, comm_ms) of the steps with communication counters).
Pending = tuple[str, int, list[StepRow], list[DeviceRow], int, list[tuple[int, float | None]]]


def _comm_means(comm: list[tuple[int, float | None]]) -> tuple[float | None, float | None]:
    """Mean comm bytes and comm ms per step over the steps that carried them."""
    if not comm:
        return None, None
    ms = [m for _, m in comm if m is not None]
    return sum(b for b, _ in comm) / len(comm), (sum(ms) / len(ms) if ms else None)


def aggregate_windows(taken: list[Pending]) -> list[Window]:
    """One ``Window`` (means over the steps) per rank of ``take_pending``'s result. Pure:
    it reads only the lists it is given, so it may run off the event loop."""
    out = []
    for job, rank, steps, device, dropped, comm in taken:
        n = len(steps)
        comm_bytes, comm_ms = _comm_means(comm)
        cols = list(zip(*steps, strict=True))
        out.append(Window(
            job=job, rank=rank, t_start=steps[0][STEP_T], t_end=steps[-1][STEP_T],
            batch_index_start=min(cols[STEP_BATCH]), batch_index_end=max(cols[STEP_BATCH]), n_steps=n,
            placement_version=steps[-1][STEP_VERSION], local_batch_size=sum(cols[STEP_LOCAL_BATCH]) / n,
            **{f: sum(cols[i]) / n for f, i in zip(STEP_TIMES, _TIME_COLUMNS, strict=True)},
            dropped=dropped, device=_device(device[-1]) if device else None,
            comm_bytes=comm_bytes, comm_ms=comm_ms,
        ))
    return out

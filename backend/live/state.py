"""Live per-job, per-rank state: ring buffers of what the hooks sent, and derived numbers.

Writes come from the ingest handler (one call per websocket message, never per record);
reads take a consistent snapshot under one lock, so the Prometheus collector, REST routes
and the controller may read from any thread.

Derived numbers use each rank's last ``window_steps`` steps:
- ``compute_ms``, ``step_ms`` ...: means over that window.
- ``step_rate_hz``: steps per second over that window (from the records' ``t``).
- job ``imbalance``: ``max_i compute_i / mean_i compute_i - 1`` over ranks with data
  and samples (0 = perfectly balanced; 1.0 = the slowest rank computes twice as long as the
  average); a drained rank's one-sample placeholder batch is left out.
- job ``idle_fraction``: ``1 - mean_i compute_i / max_i compute_i``, the share of paid
  accelerator time spent waiting for the slowest rank.

The ring buffers hold plain tuples (``backend.live.rows``: why, and the ``STEP_*``
indices). Readers get objects back (``recent_steps``, ``steps``, ``recent_device``) or the
rows themselves (``*_rows``) where they read many. Each job keeps its step-time histogram
(``backend.live.histogram``), each rank its memory-fit cache (``backend.live.memory_fit``);
what a persistence flush takes is aggregated by ``backend.live.windows``.

One module, over 400 lines on purpose: what reads or writes the live rows under their one
lock; the row layout (live/rows.py) and the windowed figures (live/windows.py) are apart."""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any, TypeVar

from backend.live.hangs import hung_rank
from backend.live.histogram import StepHistogram, cumulative
from backend.live.memory_fit import MemoryFitCache
from backend.live.pipeline import PipelineBook
from backend.live.rows import (
    STEP_BATCH,
    STEP_LOCAL_BATCH,
    STEP_MS,
    STEP_T,
    STEP_VERSION,
    TIME_COLUMNS,
    DeviceRow,
    StepRow,
    comm_steps,
    device_row,
    device_sample,
    node_device_rows,
    step_record,
    step_row,
)
from backend.live.views import JobView, RankView, eta_seconds
from backend.live.windows import Pending, Window, aggregate_windows, work_rates
from backend.policy.comm import Communication, assess
from backend.policy.memory import MemoryReading, RankMemory
from rebalancer_wire.node import NodeMetrics
from rebalancer_wire.protocol import (
    STEP_TIMES,
    DeviceSample,
    Hang,
    Hello,
    MeshShape,
    Metrics,
    StepRecord,
)

__all__ = ["LiveState", "RankView", "JobView", "eta_seconds"]


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
    # The newest device sample as an object, built on first read.
    device_obj: DeviceSample | None = None
    memory: MemoryFitCache = field(default_factory=MemoryFitCache)
    # A mesh replica's leader: the global rank its newest steps named slowest (StepRecord.slowest_rank).
    slowest: deque[int] = field(default_factory=lambda: deque(maxlen=_SLOWEST_STEPS))
    # (batch_index, work, batch_work, work_sq, batch_work_sq) of steps with a cost (sq: lengths).
    work: deque[tuple[int, float, float, float | None, float | None]] = field(default_factory=lambda: deque(maxlen=_WORK_ROWS))
    # (batch_index, comm_bytes, comm_ms) of the steps that carried communication counters.
    comm: deque[tuple[int, int, float | None]] = field(default_factory=lambda: deque(maxlen=_COMM_READINGS))
    # (batch_index, host_ms, ckpt_ms, gc_ms summed) of the steps that carried phases (docs/causes.md).
    phases: deque[tuple[int, float, float, float]] = field(default_factory=lambda: deque(maxlen=_WORK_ROWS))
    hang: Hang | None = None  # its watchdog's stall report, until a newer step ends


@dataclass(slots=True)
class _Job:
    job: str
    world_size: int
    global_batch_size: int
    created_at: float
    last_seen: float
    ranks: dict[int, _Rank] = field(default_factory=dict)
    total_steps: int | None = None  # the newest a hook said (hello or metrics)
    mesh: MeshShape | None = None  # a device-mesh job's shape, as its newest hello said it
    micro_batches: bool = False  # shares count micro-batches (Hello.micro_batches)
    left_at: float = 0.0  # when its last connected rank went away
    step_hist: StepHistogram = field(default_factory=StepHistogram)  # rank 0's step times
    # The newest ``communication`` answer: the ranks' revisions it was computed at, when it
    # was done and what it cost (seconds of ``LiveState.clock``).
    comm_cached: tuple[tuple[int, ...], Communication, float, float] | None = None


def _run_ended(j: _Job) -> bool:
    """Every rank of job ``j`` said goodbye since its hello (under the live-state lock)."""
    return len(j.ranks) == j.world_size and all(x.goodbye for x in j.ranks.values())


_WORK_ROWS = 512  # work rows kept per rank: more than a policy window
_SLOWEST_STEPS = 64  # slowest members kept per replica leader: more than a view's window
_COMM_READINGS = 256  # steps with communication counters kept per rank
_COMM_REUSE = 10.0  # a communication answer is reused until this many times its cost old


# The optional step fields live state keeps beside the rows, in ``_step_extras``'s order.
_EXTRA_COLUMNS = ("work", "batch_work", "work_sq", "batch_work_sq", "comm_bytes", "comm_ms", "slowest_rank",
                  "host_ms", "ckpt_ms", "gc_ms", "mem_peak_bytes", "mem_total_bytes", "mem_reserved_bytes")


def _step_extras(r: _Rank, k: int, local: int, work: float | None, batch_work: float | None,
                 work_sq: float | None, batch_work_sq: float | None, comm_bytes: int | None,
                 comm_ms: float | None, slowest: int | None, host_ms: float | None, ckpt_ms: float | None,
                 gc_ms: list[float] | None, mem_peak: int | None, mem_total: int | None,
                 mem_reserved: int | None) -> None:
    """A step's optional fields into the rank's side buffers (lock held)."""
    if work is not None and batch_work is not None:
        r.work.append((k, work, batch_work, work_sq, batch_work_sq))
    if comm_bytes is not None:
        r.comm.append((k, comm_bytes, comm_ms))
        r.pending_comm.append((comm_bytes, comm_ms))
    if slowest is not None:
        r.slowest.append(slowest)
    if host_ms is not None or ckpt_ms is not None or gc_ms is not None:
        r.phases.append((k, host_ms or 0.0, ckpt_ms or 0.0, sum(gc_ms) if gc_ms else 0.0))
    if mem_peak is not None:
        r.memory.add(MemoryReading(local, mem_peak, mem_total, mem_reserved))


_T = TypeVar("_T")


def _newest(ring: deque[_T], n: int | None) -> tuple[_T, ...]:
    """The newest ``n`` items of ``ring`` (all when ``n`` is None), oldest first; O(n) from the
    newest end. Callers hold the lock."""
    if n is None or n >= len(ring):
        return tuple(ring)
    if n <= 0:
        return ()
    tail = list(islice(reversed(ring), n))
    tail.reverse()
    return tuple(tail)


def _mean(vals: list[float]) -> float:
    return sum(vals) / len(vals)


class LiveState:
    """In-memory state of every job the backend has heard from since it started."""

    def __init__(self, *, step_buffer: int = 2048, device_buffer: int = 600, window_steps: int = 20,
                 clock: Callable[[], float] = time.perf_counter):
        self.step_buffer = step_buffer
        self.clock = clock  # times the communication assessment (its cost and age)
        self.device_buffer = device_buffer
        self.window_steps = window_steps
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self.pipelines = PipelineBook(window_steps)  # pipelined jobs' shapes and stage times
        self.messages_total = 0
        self.records_total = 0
        self.dropped_total = 0
        self.refused_frames: dict[tuple[str, str], int] = {}  # (frame kind, error code) -> frames refused

    def count_refused(self, frame: str, reason: str) -> None:
        """A hook frame refused at the edge (the ingest's count; /metrics exports it)."""
        with self._lock:
            self.refused_frames[(frame, reason)] = self.refused_frames.get((frame, reason), 0) + 1

    def refused(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self.refused_frames)

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
            self.pipelines.register(hello, new_run)
            job.last_seen = now
            if hello.total_steps is not None:
                job.total_steps = hello.total_steps
            job.mesh = hello.mesh
            job.micro_batches = hello.micro_batches
            old = job.ranks.get(hello.rank)
            if old is None:
                job.ranks[hello.rank] = _Rank(
                    hello=hello, steps=deque(maxlen=self.step_buffer),
                    device=deque(maxlen=self.device_buffer), first_seen=now, last_seen=now,
                )
            else:  # a reconnect keeps the history in the buffers
                old.hello, old.connected, old.lost, old.last_seen = hello, True, False, now
                old.goodbye = False
                old.memory.hello_changed()
                old.rev += 1
            return new_run

    def add_metrics(self, msg: Metrics, now: float | None = None) -> None:
        """Append one metrics message of a registered rank (unknown ranks raise KeyError)."""
        now = time.time() if now is None else now
        with self._lock:
            job = self._jobs[msg.job]
            r = job.ranks[msg.rank]
            rows = list(map(step_row, msg.steps))
            for s in msg.steps:
                _step_extras(r, s.batch_index, s.local_batch_size, s.work, s.batch_work, s.work_sq,
                             s.batch_work_sq, s.comm_bytes, s.comm_ms, s.slowest_rank, s.host_ms, s.ckpt_ms,
                             list(s.gc_ms) if s.gc_ms else None, s.mem_peak_bytes, s.mem_total_bytes,
                             s.mem_reserved_bytes)
            self._fold(job, msg.rank, r, rows, list(map(device_row, msg.device)), msg.dropped, msg.total_steps, now)
            if msg.hang is not None:
                r.hang = msg.hang
            self.pipelines.add(msg, r.hello)
            self.messages_total += 1

    def add_node_metrics(self, frame: NodeMetrics, skip: Collection[int] = (), now: float | None = None) -> int:
        """Fold a node frame (``rebalancer_wire.node``) in one pass under one lock: the rows
        are zipped from its columns (no record object per step), each rank takes its slice;
        the ranks in ``skip`` (refused alone) are left out. Returns the records folded."""
        now = time.time() if now is None else now
        rows, dev = frame.step_rows(), node_device_rows(frame)
        c = frame.steps
        extras = [c.get(f) for f in _EXTRA_COLUMNS]
        has_extras = any(col is not None for col in extras)
        folded = 0
        with self._lock:
            job = self._jobs[frame.job]
            for i, (rank, s0, s1, d0, d1) in enumerate(frame.spans()):
                if rank in skip:
                    continue
                r = job.ranks[rank]
                if has_extras:
                    for j in range(s0, s1):
                        _step_extras(r, c["batch_index"][j], c["local_batch_size"][j],
                                     *(col[j] if col is not None else None for col in extras))
                self._fold(job, rank, r, rows[s0:s1], dev[d0:d1], frame.dropped[i],
                           frame.total_steps[i] if frame.total_steps else None, now)
                folded += s1 - s0 + d1 - d0
            self.messages_total += 1
        return folded

    def _fold(self, job: _Job, rank: int, r: _Rank, rows: list[StepRow], dev: list[DeviceRow], dropped: int,
              total_steps: int | None, now: float) -> None:
        """One rank's rows into its rings and pending lists (lock held)."""
        if r.hang is not None and rows and max(row[STEP_T] for row in rows) > r.hang.since:
            r.hang = None  # steps resumed
        if rank == 0:
            job.step_hist.observe_ms(row[STEP_MS] for row in rows)
        r.steps.extend(rows)
        r.pending.extend(rows)
        if dev:
            r.device.extend(dev)
            r.device_obj = None
            r.pending_device.extend(dev)
        r.dropped += dropped
        r.pending_dropped += dropped
        if total_steps is not None:
            job.total_steps = total_steps
        r.messages += 1
        r.rev += 1
        r.last_seen = job.last_seen = now
        self.records_total += len(rows) + len(dev)
        self.dropped_total += dropped

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

    def mesh(self, job: str) -> MeshShape | None:
        """A live mesh job's shape as its hellos said it; None for plain data parallel or unknown."""
        with self._lock:
            j = self._jobs.get(job)
            return j.mesh if j is not None else None

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
            return j is not None and _run_ended(j)

    def forget(self, job: str) -> None:
        with self._lock:
            self._jobs.pop(job, None)
        self.pipelines.forget(job)

    # --- reads ----------------------------------------------------------------------------

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)

    def __contains__(self, job: object) -> bool:
        with self._lock:
            return job in self._jobs

    def rank_count(self, job: str) -> int:
        """Ranks of ``job`` that said hello (connected or not)."""
        with self._lock:
            j = self._jobs.get(job)
            return len(j.ranks) if j else 0

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
            return r.memory.summary(r.hello) if r is not None else None

    def memory_readings(self, job: str, rank: int) -> tuple[MemoryReading, ...]:
        """The rank's buffered peak-memory readings, oldest first."""
        with self._lock:
            j = self._jobs.get(job)
            r = j.ranks.get(rank) if j else None
            return tuple(r.memory.readings) if r else ()

    def step_histogram(self, job: str) -> tuple[tuple[int, ...], float] | None:
        """The job's step-time histogram: cumulative counts per ``STEP_BUCKETS_S`` bound
        then +Inf, and the sum of the steps in seconds (None if the job is unknown)."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return None
            counts, total = j.step_hist.snapshot()
        return cumulative(counts), total

    def communication(self, job: str) -> Communication | None:
        """The job's communication and what bounds its step over the newest
        ``window_steps`` steps (``backend.policy.comm.assess``); None if the job is unknown.

        The answer is computed again once a rank sent a step, but not before it is
        ``_COMM_REUSE`` times as old as it took to compute: at thousands of ranks one
        assessment takes a fifth of a second, and the dashboard, ``/metrics``, REST and the
        policy all ask for it, so it stays within a tenth of a core (a small job's costs
        microseconds and follows every step)."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return None
            key = tuple(r.rev for _, r in sorted(j.ranks.items()))
            cached = j.comm_cached
            started = self.clock()
            if cached is not None and (cached[0] == key or started - cached[2] < _COMM_REUSE * cached[3]):
                return cached[1]
            n = self.window_steps
            kind = next((r.hello.comm_kind for r in j.ranks.values() if r.hello.comm_kind), "")
            taken = {rank: (list(islice(reversed(r.steps), n)), list(islice(reversed(r.comm), 2 * n)))
                     for rank, r in j.ranks.items()}
            world = j.world_size
        steps = {rank: comm_steps(rows, comm) for rank, (rows, comm) in taken.items()}
        result = assess(kind, world, steps, window=n)
        done = self.clock()
        with self._lock:
            j = self._jobs.get(job)
            if j is not None:
                j.comm_cached = (key, result, done, done - started)
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
            total_steps, mesh, micro = j.total_steps, j.mesh, j.micro_batches
            ended = _run_ended(j)
            reports = [(rank, r.hang) for rank, r in j.ranks.items() if r.hang is not None]
            silent = [(rank, r.steps[-1][STEP_BATCH] if r.steps else None, r.steps[-1][STEP_T] if r.steps else r.last_seen)
                      for rank, r in j.ranks.items() if r.hang is None and r.connected] if reports else []
        with_data = [r for r in ranks if r.compute_ms is not None]
        # A drained rank (share 0) trains a one-sample placeholder batch whose weight is 0:
        # its compute says nothing of the job's balance, so imbalance and idle leave it out.
        compute = [r.compute_ms for r in with_data if r.compute_ms is not None and r.local_batch_size != 0]
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
            lost_ranks=tuple(r.rank for r in ranks if r.lost), mesh=mesh, ended=ended,
            hung=hung_rank(reports, silent), micro_batches=micro,
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
            means = [sum(cols[i]) / n for i in TIME_COLUMNS]
        if r.device_obj is None and r.device:
            r.device_obj = device_sample(r.device[-1])
        h = r.hello
        times: dict[str, Any] = dict(zip(STEP_TIMES, means, strict=True))
        view = RankView(
            rank=rank, host=h.host, device_type=h.device_type, device_name=h.device_name,
            mem_total_bytes=h.mem_total_bytes, connected=r.connected, first_seen=r.first_seen,
            last_seen=r.last_seen,
            batch_index=last[STEP_BATCH] if last is not None else None,
            placement_version=last[STEP_VERSION] if last is not None else None,
            local_batch_size=last[STEP_LOCAL_BATCH] if last is not None else None,
            **times,
            step_rate_hz=rate, n_steps=len(r.steps), dropped=r.dropped,
            device=r.device_obj, lost=r.lost,
            memory=r.memory.summary(h), mem_peak_bytes=r.memory.peak_bytes,
            gpu_index=h.gpu_index, gpu_uuid=h.gpu_uuid,
        )
        if r.work and win:
            work_per_s, work_share = work_rates(r.work, win)
            view = replace(view, work_per_s=work_per_s, work_share=work_share)
        if r.phases and win:
            ph = {p[0]: p for p in r.phases}
            got = [ph.get(row[STEP_BATCH], (0, 0.0, 0.0, 0.0)) for row in win]
            view = replace(view, host_ms=sum(p[1] for p in got) / n, ckpt_ms=sum(p[2] for p in got) / n,
                           gc_ms=sum(p[3] for p in got) / n)
        if h.replica_ranks:
            recent = list(islice(reversed(r.slowest), self.window_steps))
            slowest = max(h.replica_ranks, key=recent.count) if recent else None  # ties: the lowest rank
            view = replace(view, members=h.replica_ranks, member_devices=h.replica_devices, slowest_rank=slowest)
        r.cached = (r.rev, view)
        return view

    def recent_steps(self, job: str, rank: int, n: int | None = None) -> tuple[StepRecord, ...]:
        """The last ``n`` (default: all buffered) step records of a rank, oldest first."""
        return tuple(map(step_record, self.recent_step_rows(job, rank, n)))

    def recent_step_rows(self, job: str, rank: int, n: int | None = None) -> tuple[StepRow, ...]:
        """``recent_steps`` as rows in ``STEP_FIELDS`` order (no objects built)."""
        with self._lock:
            j = self._jobs.get(job)
            r = j.ranks.get(rank) if j else None
            return () if r is None else _newest(r.steps, n)

    def cause_rows(self, job: str, n: int) -> dict[int, tuple[list[tuple[Any, ...]], dict[int, Any], dict[int, Any],
                                                              dict[int, Any]]]:
        """Each rank's newest ``n`` step rows, oldest first, with its communication, phases and
        work by batch index: what ``backend.live.causes`` turns into the replay's steps."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return {}
            return {rank: (list(islice(reversed(r.steps), n))[::-1], {c[0]: c for c in r.comm},
                           {p[0]: p for p in r.phases}, {w[0]: w[1] for w in r.work})
                    for rank, r in j.ranks.items()}

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
        return tuple(map(device_sample, self.recent_device_rows(job, rank, n)))

    def recent_device_rows(self, job: str, rank: int, n: int | None = None) -> tuple[DeviceRow, ...]:
        """``recent_device`` as rows in ``DEVICE_FIELDS`` order (no objects built)."""
        with self._lock:
            j = self._jobs.get(job)
            r = j.ranks.get(rank) if j else None
            return () if r is None else _newest(r.device, n)

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
        return [(rank, step_record(s)) for rank, s in picked[-limit:]] if limit else []

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


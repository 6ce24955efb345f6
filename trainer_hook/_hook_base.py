"""HookBase: the hook's state, its start on the process group, and its I/O lifecycle.

Owns what the constructor sets up, the rank and world size, the control and replica
groups, the transport and probe threads (started by a replica's leader only), the hello,
where step records leave (history and transport), and close at the end, at exit or in a
forked child. The public surface is trainer_hook.hook.RebalanceHook, which builds on this.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from rebalancer_wire.protocol import Error, Hello, MeshShape, Message, StepRecord
from trainer_hook import _lifecycle
from trainer_hook._announce import say_start, start_line
from trainer_hook.channel import ControlChannel, PendingPlacement
from trainer_hook.config import HookConfig
from trainer_hook.gradients import GradientState
from trainer_hook.memory import (
    MemoryMeter,
    MemoryReading,
    MemorySource,
    default_memory_source,
    is_out_of_memory,
)
from trainer_hook.mesh import ReplicaPace, device_label, mesh_shape, replica_of
from trainer_hook.phases import GcSchedule, PhaseClock
from trainer_hook.placement import PlacementSchedule, ScheduledPlacement
from trainer_hook.sampler import RebalanceBatchSampler
from trainer_hook.timing import StepTimer
from trainer_hook.watchdog import Watchdog

log = logging.getLogger("trainer_hook")
HOOK_VERSION = "0.1.0"
# The collective each gradient mechanism reports its bytes for (Hello.comm_kind).
_COMM_KIND = {"ddp_comm_hook": "all_reduce", "fsdp2_reduce_scatter": "reduce_scatter",
              "fsdp1_comm_hook": "reduce_scatter"}
# How long close() at interpreter exit waits for the exchange in flight: every rank
# launched it, so it is normally complete; a peer stuck elsewhere must not hold the exit.
_EXIT_WAIT_S = 30.0
_AUTO: Any = object()
_UNMEASURED = 1 << 40  # lookahead before the first step measures it: nothing is final yet


class _Steps(Protocol):
    """What a step's context calls: the hook's step loop (trainer_hook._steps.StepLoop)."""

    def _begin_step(self) -> int: ...

    def _end_step(self, *, failed: bool) -> None: ...

    def _report_oom(self, exc: BaseException) -> None: ...


class _StepContext:
    """The object ``hook.step()`` returns; reused every step to keep the hot path small."""

    __slots__ = ("_hook",)

    def __init__(self, hook: _Steps) -> None:
        self._hook = hook

    def __enter__(self) -> int:
        return self._hook._begin_step()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and is_out_of_memory(exc):
            self._hook._report_oom(exc)  # before the exception reaches the training loop
        self._hook._end_step(failed=exc_type is not None)


class HookBase:
    """State and lifecycle of a RebalanceHook (see trainer_hook.hook for the public API)."""

    def __init__(
        self,
        server: str | None = None,
        job: str | None = None,
        global_batch_size: int | None = None,
        token: str | None = None,
        *,
        memory_source: MemorySource | None = _AUTO,
        dp_mesh: Any = None,
        **config: Any,
    ) -> None:
        self.config = HookConfig.from_env(
            server=server, job=job, global_batch_size=global_batch_size, token=token, **config
        )
        cfg = self.config
        self._lock = threading.Lock()
        # dp_mesh: shares are per data-parallel replica (issue 24, docs/meshes.md).
        self._dp_mesh = dp_mesh
        self._root = True  # global rank 0: decides placements and their batch index
        self._members = 1  # ranks per replica (its tensor/context-parallel group)
        self._replica_ranks: tuple[int, ...] = ()
        self._replica_devices: tuple[str, ...] = ()  # each member's host and device
        self._mesh: MeshShape | None = None  # the job's mesh shape, for the hello
        self._pace: ReplicaPace | None = None  # combines the replica's records (members > 1)
        self._entry_wait = 0.0  # seconds the pace check after the last step waited (sync wait)
        # The lookahead in force: given, or measured at the first step (None until then).
        self._lookahead: int | None = cfg.lookahead if isinstance(cfg.lookahead, int) else None
        self._known_lookahead = 0  # what hook.data_loader() knows its loader needs
        self._agree_at = 0  # the batch index at which to measure and agree on it
        self._grads = GradientState()
        self._phases = PhaseClock()  # GC pauses, loader and checkpoint time of each step
        self._phases.install()
        self._timer = StepTimer(phases=self._phases)
        gcs = GcSchedule(freeze=cfg.gc_freeze, every=cfg.gc_collect_every)
        self._gc_schedule: GcSchedule | None = gcs if gcs.active else None  # None: Python's own
        source = default_memory_source() if memory_source is _AUTO else memory_source
        self._memory: MemoryMeter | None = (
            MemoryMeter(source, every=cfg.memory_every) if source is not None else None)
        self._mem_pending: MemoryReading | None = None
        self._ctx = _StepContext(cast("_Steps", self))  # only ever built with the step loop
        self._sampler: RebalanceBatchSampler | None = None
        self._next_batch = 0
        self._epoch_restored: int | None = None
        self._trained_version: int | None = None
        self._full_for: ScheduledPlacement | None = None  # placement self._full was computed for
        self._full: tuple[int, float] = (0, 0.0)  # (local samples, weight) of a full batch under it
        self._started = False
        self._closed = False
        self._gradients_mode: str | None = None
        self._grad_handles: list[Any] = []
        self._norms: list[torch.nn.Module] = []  # batch norms kept out of dummy steps
        self._frozen: list[torch.nn.Module] = []
        # Micro-batch placements (trainer_hook.microbatch): the rank's stream, this step's
        # micro-batches, the step's token factor, the model's gradient-sync switch.
        self._in_step = False
        self._model: torch.nn.Module | None = None
        self._sync_switch: Any = lambda on: None
        self._stream: Any = None
        self._stream_resume: dict[str, Any] | None = None
        self._mb: Any = None
        self._mb_tokens: Any = None
        self.history: deque[StepRecord] = deque(maxlen=cfg.history)
        self.acks: list[tuple[int, int]] = []
        self.rejections: list[tuple[int, str]] = []
        self.last_error: Error | None = None
        self._initial: PendingPlacement | None = None
        self._initial_event = threading.Event()
        self._epoch_seen = 0  # the highest lease epoch of a backend placement (rank 0)
        self._transport: Any = None
        self._probe: Any = None
        self._watchdog: Watchdog | None = None
        self._training_thread = threading.get_ident()  # whose stack a hang report carries
        self._forked = False
        self._ready = False
        # Created before the process group (HF TrainingArguments and Accelerate's
        # Accelerator make it): the rest waits for the first use.
        if (dist.is_available() and dist.is_initialized()) or _env_world_size() <= 1:
            self._init_distributed("RebalanceHook()")

    def _init_distributed(self, where: str) -> None:
        """Once: rank, world size, the placement schedule, the control group and the I/O."""
        if self._ready:
            return
        self._rank, self._world_size = _rank_and_world(where)
        global_world, leader = self._world_size, True
        self._root = self._rank == 0
        replicas = None
        if self._dp_mesh is not None:
            replicas = replica_of(self._dp_mesh, device_label())
            self._rank, self._world_size, self._replica_ranks = replicas.replica, replicas.replicas, replicas.members
            self._replica_devices = replicas.devices
            self._members = len(self._replica_ranks)
            leader = dist.get_rank() == self._replica_ranks[0]
            self._mesh = mesh_shape(self._dp_mesh, replicas.replicas, self._members)
        cfg = self.config
        b = cfg.global_batch_size
        if b < self._world_size:
            raise ValueError(
                f"global_batch_size ({b}) must be at least the world size ({self._world_size}) "
                "so the uniform split gives every rank a sample."
            )
        self._schedule = PlacementSchedule(self._world_size, b)
        group = dist.new_group(backend="gloo") if global_world > 1 else None
        # Measured: settle nothing in particular until the first step agrees on it; no
        # exchange can start a placement before then.
        lookahead = self._lookahead if self._lookahead is not None else _UNMEASURED
        self._channel = ControlChannel(
            rank=0 if self._root else 1 + self._rank, world_size=self._world_size, schedule=self._schedule,
            exchange_every=cfg.exchange_every, exchange_lag=cfg.exchange_lag,
            lookahead=lookahead, group=group,
        )
        if replicas is not None and self._members > 1:
            # The replica's own gloo group, where its members' step times meet. Created by
            # its members only (local synchronisation): no world-wide barrier per replica.
            mine = dist.new_group(list(replicas.members), backend="gloo", use_local_synchronization=True)
            self._pace = ReplicaPace(mine, leader=leader, report=self._report_many, members=replicas.members,
                                     position=replicas.members.index(dist.get_rank()))
        self._trained: ScheduledPlacement = self._schedule.at(0)
        self._ready = True
        if global_world == 1 or (dist.is_available() and dist.is_initialized() and dist.get_rank() == 0):
            unit = "ranks" if self._dp_mesh is None else "data-parallel replicas"
            say_start(start_line(cfg, self._world_size, unit))  # one line for the job, from rank 0
        if not cfg.offline and leader:  # only a replica's leader talks to the backend
            self._start_io()
        _lifecycle.track(self)  # after init_process_group: its atexit runs before torch's

    def _report(self, rec: StepRecord) -> None:
        self.history.append(rec)
        if self._transport is not None:
            self._transport.put_step(rec)

    def _report_many(self, recs: Sequence[StepRecord]) -> None:
        """The pace thread: a replica's combined records (deque appends are thread-safe)."""
        for rec in recs:
            self._report(rec)

    def _on_message(self, msg: Message) -> None:
        """Transport thread: a backend message (trainer_hook._placements acts on it)."""
        raise NotImplementedError

    # --- I/O -------------------------------------------------------------------------

    def _start_io(self) -> None:
        from trainer_hook.node_agg import make_transport
        from trainer_hook.probe import DeviceProbe

        cfg = self.config
        device_index = None
        if torch.cuda.is_available():
            device_index = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        self._transport = make_transport(  # through the node's agent where torchrun runs several ranks
            job=cfg.job_name, url=cfg.server or "", token=cfg.token, hello=self._hello,
            on_message=self._on_message, max_queue=cfg.max_queue, flush_interval_s=cfg.flush_interval_s,
            flush_on_deviation=cfg.flush_on_deviation,
        )
        self._probe = DeviceProbe(
            interval_s=cfg.probe_interval_s, device_index=device_index, on_sample=self._transport.put_device
        )
        self._transport.total_steps = cfg.total_steps
        self._transport.start()
        self._probe.start()
        if cfg.hang_after_s > 0:
            self._watchdog = Watchdog(where=self._where, report=self._transport.put_hang,
                                      after_s=cfg.hang_after_s, thread_id=self._training_thread)
            self._watchdog.start()

    def _where(self) -> tuple[int, str, float, float] | None:
        """The watchdog's thread: where training is (``trainer_hook.watchdog.Where``)."""
        t = self._timer
        prev = t._prev_end
        if prev is None:
            return None
        last = self.history[-1] if self.history else None
        step_s = last.step_ms / 1e3 if last is not None else 0.0
        if t._t0 > prev:  # inside hook.step()
            g = self._grads
            phase = "compute" if g.last_bucket_t is None else "sync_wait" if g.last_done_t is None else "optimizer"
            return t._meta[0], phase, prev, step_s
        return self._next_batch, "data_wait", prev, step_s

    def _hello(self) -> Hello:
        device_type, device_name, mem_total = "CPU", "", None
        gpu_index, gpu_uuid = None, ""
        if self._probe is not None:
            try:
                device_type, device_name, mem_total = self._probe.describe()
                gpu_index, gpu_uuid = self._probe.identity()
            except Exception:  # a probe failure must not stop the connection
                log.debug("device probe describe() failed", exc_info=True)
        return Hello(
            job=self.config.job_name, rank=self._rank, world_size=self._world_size,
            global_batch_size=self.config.global_batch_size,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")), host=socket.gethostname(),
            pid=os.getpid(), device_type=device_type, device_name=device_name,
            mem_total_bytes=mem_total, placement_version=self._trained.version,
            batch_index=self._next_batch,
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            hook_version=HOOK_VERSION, total_steps=self.config.total_steps,
            memory_source=self._memory.source.name if self._memory is not None else "",
            gpu_index=gpu_index, gpu_uuid=gpu_uuid,
            comm_kind=_COMM_KIND.get(self._gradients_mode or "", ""), mesh=self._mesh,
            replica_ranks=self._replica_ranks if self._mesh is not None else (),
            replica_devices=self._replica_devices if self._mesh is not None else (),
            mode=self.config.mode or "",
            micro_batches=self.config.micro_batches is not None,
        )

    def _close(self, *, wait_for_peers: bool, wait_timeout_s: float | None) -> None:
        if self._closed:
            return
        self._closed = True
        _lifecycle.forget(self)  # nothing left for the exit handler
        self._phases.uninstall()
        if self._gc_schedule is not None:
            self._gc_schedule.restore()
        if not self._ready:
            return  # never used: no group, no threads
        try:
            if wait_for_peers:
                self._channel.close(timeout_s=wait_timeout_s)
            if self._pace is not None:  # the records of the last window(s), combined if peers wait
                pace = self._pace
                for r in pace.flush(self._next_batch, wait_timeout_s) if wait_for_peers else pace.release():
                    self._report(r)  # held by the leader only
        finally:
            self._release_process_groups()
            if self._watchdog is not None:
                self._watchdog.stop()
            if self._probe is not None:
                self._probe.stop()
            if self._transport is not None:
                self._transport.close()
            for h in self._grad_handles:
                h.remove()
            if not self._grads.release_callbacks():
                log.warning("a gradient all-reduce callback was still held by a communication thread at close()")

    def _close_at_exit(self) -> None:
        """The atexit path (trainer_hook._lifecycle): close with a bounded wait for peers."""
        self._close(wait_for_peers=True, wait_timeout_s=_EXIT_WAIT_S)

    def _after_fork_in_child(self) -> None:
        """In a forked child: inert, touching nothing the parent still uses (see _lifecycle)."""
        self._lock = threading.Lock()
        self._initial_event = threading.Event()
        self._closed = True
        self._forked = True
        self._phases.uninstall()
        self._grads._pg = None
        self._grads._opts = None
        self._channel.after_fork_in_child()
        if self._pace is not None:
            self._pace.after_fork_in_child()
        if self._probe is not None:
            self._probe.after_fork_in_child()
        if self._transport is not None:
            self._transport.after_fork_in_child()

    def _release_process_groups(self) -> None:
        # A process group that Python still references outlives destroy_process_group()
        # and is torn down during interpreter finalisation, where gloo's worker threads
        # can abort the process (SIGABRT, "terminate called without an active
        # exception"). Destroy the hook's own control group now and drop the cached
        # handle to the gradient group, so both die while the interpreter is whole.
        self._grads._pg = None
        self._grads._opts = None
        group, self._channel.group = self._channel.group, None
        pace_group = None
        if self._pace is not None:
            pace_group, self._pace.group = self._pace.group, None
        for g in (group, pace_group):
            if g is not None and dist.is_available() and dist.is_initialized():
                try:
                    dist.destroy_process_group(g)
                except (RuntimeError, ValueError) as exc:  # already gone with the default group
                    log.debug("control group was already destroyed: %s", exc)


def _env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def _rank_and_world(where: str) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = _env_world_size()
    if world > 1:
        raise RuntimeError(
            f"{where} needs the process group, but WORLD_SIZE is {world} and torch.distributed "
            "is not initialised yet. The hook may be created first, but before using it create "
            "what starts the group: dist.init_process_group(...) in a torchrun script, the HF "
            "TrainingArguments (RebalancingTrainer) or the Accelerate Accelerator."
        )
    return 0, 1

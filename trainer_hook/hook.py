"""RebalanceHook: the public API that wires sampler, gradients, control and metrics.

Example (torchrun, one process per rank)::

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from trainer_hook import RebalanceHook

    dist.init_process_group("gloo")
    hook = RebalanceHook(server="http://127.0.0.1:8000", job="demo", global_batch_size=256)
    model = DDP(model); hook.attach(model)
    loader = DataLoader(ds, batch_sampler=hook.batch_sampler(ds, shuffle=True, seed=0))
    for x, y in loader:
        with hook.step():
            loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    hook.close()
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Sized
from typing import Any

import torch
import torch.distributed as dist

from trainer_hook.config import HookConfig, check_total_steps
from trainer_hook.control import ControlChannel, PendingPlacement
from trainer_hook.gradients import GradientState, register_comm_hook, register_grad_timer
from trainer_hook.placement import PlacementSchedule, ScheduledPlacement
from trainer_hook.protocol import (
    Ack,
    Error,
    Hello,
    Message,
    Placement,
    Reject,
    StepRecord,
    check_shares,
)
from trainer_hook.sampler import RebalanceBatchSampler
from trainer_hook.timing import StepTimer

__all__ = ["RebalanceHook"]

log = logging.getLogger("trainer_hook")
HOOK_VERSION = "0.1.0"
_GRADIENT_MODES = ("comm_hook", "loss_scale")


class _StepContext:
    """The object ``hook.step()`` returns; reused every step to keep the hot path small."""

    __slots__ = ("_hook",)

    def __init__(self, hook: RebalanceHook) -> None:
        self._hook = hook

    def __enter__(self) -> int:
        return self._hook._begin_step()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._hook._end_step(failed=exc_type is not None)


class RebalanceHook:
    """Measures this rank and applies placements of the global batch in lockstep.

    ``RebalanceHook(server=None, job=None, global_batch_size=..., token=None, **config)``;
    ``server``, ``job`` and ``token`` fall back to ``REBALANCER_SERVER``,
    ``REBALANCER_JOB`` and ``REBALANCER_TOKEN``. With no server the hook runs offline:
    nothing touches the network, steps are still timed, and ``request_placement`` on
    rank 0 still changes the split. Other keyword arguments are HookConfig fields
    (``exchange_every``, ``exchange_lag``, ``lookahead``, ...). Create it on every rank
    after ``dist.init_process_group`` (it makes a CPU gloo group for placements).

    The loop needs three things from it: ``attach(model)`` (gradient weighting),
    ``batch_sampler(dataset)`` (this rank's slice of each global batch) and one
    ``with hook.step():`` around each batch's forward, backward and optimizer step.
    """

    def __init__(
        self,
        server: str | None = None,
        job: str | None = None,
        global_batch_size: int | None = None,
        token: str | None = None,
        **config: Any,
    ) -> None:
        self.config = HookConfig.from_env(
            server=server, job=job, global_batch_size=global_batch_size, token=token, **config
        )
        self._rank, self._world_size = _rank_and_world()
        b = self.config.global_batch_size
        if b < self._world_size:
            raise ValueError(
                f"global_batch_size ({b}) must be at least the world size ({self._world_size}) "
                "so the uniform split gives every rank a sample."
            )
        self._lock = threading.Lock()
        self.schedule = PlacementSchedule(self._world_size, b)
        group = dist.new_group(backend="gloo") if self._world_size > 1 else None
        cfg = self.config
        self._control = ControlChannel(
            rank=self._rank, world_size=self._world_size, schedule=self.schedule,
            exchange_every=cfg.exchange_every, exchange_lag=cfg.exchange_lag,
            lookahead=cfg.lookahead, group=group,
        )
        self._grads = GradientState()
        self._timer = StepTimer()
        self._ctx = _StepContext(self)
        self._sampler: RebalanceBatchSampler | None = None
        self._next_batch = 0
        self._trained_version: int | None = None
        self._trained: ScheduledPlacement = self.schedule.at(0)
        self._full_for: ScheduledPlacement | None = None  # placement self._full was computed for
        self._full: tuple[int, float] = (0, 0.0)  # (local samples, weight) of a full batch under it
        self._started = False
        self._closed = False
        self._gradients_mode: str | None = None
        self._grad_handles: list[Any] = []
        self.history: deque[StepRecord] = deque(maxlen=cfg.history)
        self.acks: list[tuple[int, int]] = []
        self.rejections: list[tuple[int, str]] = []
        self.last_error: Error | None = None
        self._initial: PendingPlacement | None = None
        self._initial_event = threading.Event()
        self._transport: Any = None
        self._probe: Any = None
        if not cfg.offline:
            self._start_io()

    # --- public read-only state ------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank (0 without a process group)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks (1 without a process group)."""
        return self._world_size

    @property
    def global_batch_size(self) -> int:
        return self.config.global_batch_size

    @property
    def batch_index(self) -> int:
        """The global batch index the next ``step()`` trains (counts across epochs)."""
        return self._next_batch

    @property
    def placement(self) -> ScheduledPlacement:
        """The placement of the batch trained last (version 0 before the first step)."""
        return self._trained

    @property
    def placement_version(self) -> int:
        return self._trained.version

    @property
    def shares(self) -> list[int]:
        return list(self._trained.shares)

    @property
    def last_step(self) -> StepRecord | None:
        """The newest StepRecord of this rank, or None before the first step ends."""
        return self.history[-1] if self.history else None

    @property
    def total_steps(self) -> int | None:
        """How many steps the run takes in all, if known (the backend's ETA needs it)."""
        return self.config.total_steps

    def set_total_steps(self, total_steps: int | None) -> None:
        """Tell the backend how many steps the run will take (None: unknown); any time."""
        check_total_steps(total_steps)
        self.config.total_steps = total_steps
        if self._transport is not None:
            self._transport.total_steps = total_steps

    @property
    def connected(self) -> bool:
        """True while the transport holds a live websocket (always False offline)."""
        return bool(self._transport is not None and self._transport.connected)

    @property
    def dropped(self) -> int:
        """Metric records the transport could not buffer (0 offline)."""
        return int(self._transport.dropped) if self._transport is not None else 0

    # --- set-up ----------------------------------------------------------------------

    def attach(self, model: torch.nn.Module, *, gradients: str = "comm_hook") -> torch.nn.Module:
        """Make gradients the global-batch mean whatever the split; returns ``model``.

        ``gradients="comm_hook"`` (default) registers the weighted all-reduce on a
        DistributedDataParallel model: each bucket is multiplied by this rank's share of
        the batch and summed. With one process a plain module is accepted (nothing to
        weight). ``gradients="loss_scale"`` registers nothing: multiply your local mean
        loss by ``hook.loss_weight()`` and let the framework's averaging all-reduce do the
        rest (for code where another library owns DDP's comm hook).

        Raises a clear error where exactness cannot be kept: a model that already has a
        comm hook (DDP allows one), FSDP, or a non-DDP model with several ranks.
        Gradient accumulation must use ``model.no_sync()`` for all micro-batches but the
        last, inside one ``hook.step()``, with the loss scaled to the mean over the
        rank's whole local batch; a second all-reduce inside one step raises at its end.
        """
        if gradients not in _GRADIENT_MODES:
            raise ValueError(f"gradients must be one of {_GRADIENT_MODES}, got {gradients!r}.")
        if self._gradients_mode is not None:
            raise RuntimeError("attach() was already called on this hook; call it once per model.")
        is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if gradients == "comm_hook" and (is_ddp or self._world_size > 1):
            register_comm_hook(model, self._grads)
        else:
            self._grad_handles = register_grad_timer(model, self._grads)
        self._gradients_mode = gradients
        self._ensure_started()
        return model

    def batch_sampler(
        self, dataset: Sized | int, shuffle: bool = True, seed: int = 0, drop_last: bool = False
    ) -> RebalanceBatchSampler:
        """This rank's batch sampler: pass it to ``DataLoader(batch_sampler=...)``.

        Global batch k is the same samples on every rank and under every placement; the
        sampler yields this rank's contiguous slice of it. Works with ``num_workers > 0``
        as long as the loader prefetches at most ``lookahead`` batches. A drained rank
        (share 0) gets a one-sample dummy batch whose gradient weight is 0. Each
        ``iter()`` starts at ``hook.batch_index``, so breaking out of an epoch and looping
        again continues with the next untrained batch. The hook takes the batch sizes of
        an epoch's short last batch from the sampler created last.
        """
        sampler = RebalanceBatchSampler(
            dataset, schedule=self.schedule, rank=self._rank, shuffle=shuffle, seed=seed,
            drop_last=drop_last, position=lambda: self._next_batch, before_iter=self._ensure_started,
        )
        self._sampler = sampler
        return sampler

    # --- the step --------------------------------------------------------------------

    def step(self) -> _StepContext:
        """Context manager around one global batch's forward, backward and optimizer step.

        On entry it runs the placement exchange when due, sets this rank's gradient
        weight for the batch and starts the timers; on exit it queues the StepRecord.
        No network or file I/O and no device sync happen here. ``with hook.step() as k:``
        gives the global batch index being trained.
        """
        return self._ctx

    def loss_weight(self) -> float:
        """Factor for the local mean loss on the loss-scaling path (1.0 with the comm hook).

        Equals ``world_size * local_samples / batch_samples`` for the batch being
        trained, so an all-reduce that averages over ranks yields the global-batch mean.
        Call it inside ``with hook.step():``.
        """
        if self._gradients_mode == "loss_scale":
            return self._world_size * self._grads.weight
        return 1.0

    def _begin_step(self) -> int:
        if self._closed:
            raise RuntimeError("This RebalanceHook is closed; create a new one to train further.")
        if not self._started:
            self._ensure_started()
        k = self._next_batch
        control = self._control
        if k >= control.due:  # an exchange to collect or launch; otherwise nothing to do
            control.on_step(k)
        p = self.schedule.at(k)
        sampler = self._sampler
        b = self.config.global_batch_size
        if sampler is None or sampler.batch_length(k) == b:
            # Full batch: this rank's share and weight only change with the placement.
            if p is not self._full_for:
                local = p.shares[self._rank]
                self._full = (local, local / b)
                self._full_for = p
            local, weight = self._full
        else:  # an epoch's short last batch, split in proportion by the sampler
            n = sampler.batch_length(k)
            lo, hi = sampler.local_bounds(k)
            local = hi - lo
            weight = local / n
        grads = self._grads
        grads.reset()
        grads.weight = weight
        if p.version != self._trained_version:
            self._on_new_version(p, k)
        self._trained = p
        self._timer.start(k, local, p.version, cuda=grads.cuda)
        return k

    def _end_step(self, *, failed: bool) -> None:
        rec = self._timer.finish(self._grads)
        if failed:
            return
        self._next_batch += 1
        if rec is not None:
            self.history.append(rec)
            if self._transport is not None:
                self._transport.put_step(rec)
        if self._grads.repeated_bucket:
            raise RuntimeError(
                "Gradients were all-reduced more than once in one hook.step(): gradient "
                "accumulation must wrap every micro-batch but the last in model.no_sync(), "
                "otherwise each micro-batch is weighted as a whole batch and the math changes."
            )

    def _on_new_version(self, p: ScheduledPlacement, k: int) -> None:
        if self._gradients_mode is None and self._world_size > 1 and len(set(p.shares)) > 1:
            log.warning(
                "placement version %d splits the batch unevenly but attach() was never called: "
                "gradients are not weighted by share, so training math changes. Call "
                "hook.attach(ddp_model) (or use gradients='loss_scale' with hook.loss_weight()).",
                p.version,
            )
        first = self._trained_version is None
        self._trained_version = p.version
        if first and p.version == 0:
            return
        self.acks.append((p.version, k))
        if self._transport is not None:
            self._transport.send_control(Ack(job=self.config.job_name, rank=self._rank, version=p.version, batch_index=k))

    # --- placements ------------------------------------------------------------------

    def request_placement(self, shares: list[int], reason: str = "", *, version: int | None = None) -> int:
        """Rank 0: ask for a new split of the global batch; returns its version.

        The placement is validated (one non-negative integer per rank, summing to B,
        newer than the one in force), then broadcast at the next exchange and applied by
        every rank at the same batch index. Invalid input raises ValueError with the
        reason (also sent to the backend as a ``reject``); training goes on unchanged.
        This is the same path a backend ``placement`` message takes.
        """
        if self._rank != 0:
            raise RuntimeError(
                f"request_placement() was called on rank {self._rank}; only rank 0 decides "
                "placements. Call it on rank 0 (the others learn it at the next exchange)."
            )
        with self._lock:
            if version is None:
                pending = self._control.pending
                version = 1 + max(self.schedule.latest.version, pending.version if pending else 0)
        error = self._offer(version, shares, reason, self.config.global_batch_size)
        if error is not None:
            raise ValueError(error)
        return version

    def _offer(self, version: int, shares: Any, reason: str, global_batch_size: int) -> str | None:
        """Validate and queue a placement; on failure record and report a reject."""
        error: str | None = None
        checked: list[int] = []
        with self._lock:
            latest = self.schedule.latest
            pending = self._control.pending
            newest = max(latest.version, pending.version if pending else -1)
            if global_batch_size != self.config.global_batch_size:
                error = (
                    f"placement version {version} is for global batch size {global_batch_size}, "
                    f"but this job trains with {self.config.global_batch_size}."
                )
            else:
                try:
                    checked = check_shares(shares, world_size=self._world_size, global_batch_size=global_batch_size)
                except ValueError as exc:
                    error = f"placement version {version} is invalid: {exc}"
            if error is None and version <= newest:
                known = pending if pending is not None and pending.version == version else None
                if version == latest.version and tuple(checked) == latest.shares:
                    return None  # the placement in force again (a reconnect's hello reply)
                if known is not None and known.shares == tuple(checked):
                    return None
                error = f"placement version {version} is not newer than version {newest} already in force or pending."
            if error is None:
                self._control.offer(PendingPlacement(version, tuple(checked), reason))
                return None
        self.rejections.append((version, error))
        log.warning("rejected placement: %s", error)
        if self._transport is not None:
            self._transport.send_control(Reject(job=self.config.job_name, rank=self._rank, version=version, reason=error))
        return error

    def _on_message(self, msg: Message) -> None:
        """Transport thread: a backend ``placement`` (rank 0 acts on it) or ``error``."""
        if isinstance(msg, Placement):
            if self._rank != 0:
                return  # rank 0 decides for everyone; the exchange brings it here
            with self._lock:
                startup = not self._started
            if startup:
                self._initial = PendingPlacement(msg.version, tuple(msg.shares), msg.reason)
                self._initial_event.set()
                return
            self._offer(msg.version, msg.shares, msg.reason, msg.global_batch_size)
        elif isinstance(msg, Error):
            self.last_error = msg
            log.warning("backend error %s: %s", msg.code, msg.message)

    def _ensure_started(self) -> None:
        """Once, on every rank: resume the placement in force (rank 0's view) before batch 0."""
        if self._started:
            return
        version: int | None = None
        shares: list[int] | None = None
        if self._rank == 0 and self._transport is not None:
            self._initial_event.wait(self.config.startup_wait_s)
            with self._lock:
                initial, self._initial = self._initial, None
            if initial is not None and initial.version > 0:
                try:
                    shares = check_shares(
                        list(initial.shares), world_size=self._world_size,
                        global_batch_size=self.config.global_batch_size,
                    )
                    version = initial.version
                except ValueError as exc:
                    self._reject(initial.version, f"placement version {initial.version} is invalid: {exc}")
        if not self.config.offline:
            self._control.sync_initial(version, shares)
        with self._lock:
            self._started = True
            self._trained = self.schedule.at(self._next_batch)
            late, self._initial = self._initial, None
        if late is not None:  # arrived after the wait: takes the ordinary path
            self._offer(late.version, list(late.shares), late.reason, self.config.global_batch_size)

    def _reject(self, version: int, reason: str) -> None:
        self.rejections.append((version, reason))
        log.warning("rejected placement: %s", reason)
        if self._transport is not None:
            self._transport.send_control(Reject(job=self.config.job_name, rank=self._rank, version=version, reason=reason))

    # --- I/O -------------------------------------------------------------------------

    def _start_io(self) -> None:
        from trainer_hook.probe import DeviceProbe
        from trainer_hook.transport import Transport

        cfg = self.config
        device_index = None
        if torch.cuda.is_available():
            device_index = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        self._transport = Transport(
            url=cfg.server or "", token=cfg.token, hello=self._hello,
            on_message=self._on_message, max_queue=cfg.max_queue, flush_interval_s=cfg.flush_interval_s,
        )
        self._probe = DeviceProbe(
            interval_s=cfg.probe_interval_s, device_index=device_index, on_sample=self._transport.put_device
        )
        self._transport.total_steps = cfg.total_steps
        self._transport.start()
        self._probe.start()

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
            gpu_index=gpu_index, gpu_uuid=gpu_uuid,
        )

    def close(self, *, wait_for_peers: bool = True) -> None:
        """Finish the exchange in flight, flush metrics, stop the threads. Idempotent.

        Every rank must call it after the same number of steps. ``wait_for_peers=False``
        skips waiting on the exchange in flight (shutting down on a signal, when peers
        may be gone).
        """
        if self._closed:
            return
        self._closed = True
        try:
            if wait_for_peers:
                self._control.close()
        finally:
            self._release_process_groups()
            if self._probe is not None:
                self._probe.stop()
            if self._transport is not None:
                self._transport.close()
            for h in self._grad_handles:
                h.remove()

    def _release_process_groups(self) -> None:
        # A process group that Python still references outlives destroy_process_group()
        # and is torn down during interpreter finalisation, where gloo's worker threads
        # can abort the process (SIGABRT, "terminate called without an active
        # exception"). Destroy the hook's own control group now and drop the cached
        # handle to the gradient group, so both die while the interpreter is whole.
        self._grads._pg = None
        self._grads._opts = None
        group, self._control.group = self._control.group, None
        if group is not None and dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError) as exc:  # already gone with the default group
                log.debug("control group was already destroyed: %s", exc)

    def __enter__(self) -> RebalanceHook:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        raise RuntimeError(
            f"WORLD_SIZE is {world} but no process group is initialised. Call "
            "torch.distributed.init_process_group(...) before creating RebalanceHook."
        )
    return 0, 1

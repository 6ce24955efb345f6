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
from collections.abc import Sequence, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from trainer_hook import _lifecycle
from trainer_hook.config import HookConfig, check_total_steps
from trainer_hook.control import ControlChannel, PendingPlacement
from trainer_hook.gradients import (
    GradientState,
    check_data_parallel,
    register_grad_timer,
    register_gradient_weighting,
    register_unshard_timer,
)
from trainer_hook.memory import (
    MemoryMeter,
    MemoryReading,
    MemorySource,
    default_memory_source,
    is_out_of_memory,
)
from trainer_hook.mesh import ReplicaPace, mesh_shape, replica_of
from trainer_hook.placement import PlacementSchedule, ScheduledPlacement
from trainer_hook.protocol import (
    Ack,
    Error,
    Hello,
    MeshShape,
    Message,
    Oom,
    Placement,
    Reject,
    StepRecord,
    check_shares,
)
from trainer_hook.sampler import RebalanceBatchSampler, SampleCost
from trainer_hook.timing import StepTimer

__all__ = ["RebalanceHook"]

log = logging.getLogger("trainer_hook")
HOOK_VERSION = "0.1.0"
_GRADIENT_MODES = ("auto", "comm_hook", "loss_scale")
# The collective each gradient mechanism reports its bytes for (Hello.comm_kind).
_COMM_KIND = {"ddp_comm_hook": "all_reduce", "fsdp2_reduce_scatter": "reduce_scatter",
              "fsdp1_comm_hook": "reduce_scatter"}
# How long close() at interpreter exit waits for the exchange in flight: every rank
# launched it, so it is normally complete; a peer stuck elsewhere must not hold the exit.
_EXIT_WAIT_S = 30.0
_AUTO: Any = object()
_OOM_FLUSH_S = 2.0  # how long an out-of-memory report may hold the failing step


class _StepContext:
    """The object ``hook.step()`` returns; reused every step to keep the hot path small."""

    __slots__ = ("_hook",)

    def __init__(self, hook: RebalanceHook) -> None:
        self._hook = hook

    def __enter__(self) -> int:
        return self._hook._begin_step()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and is_out_of_memory(exc):
            self._hook._report_oom(exc)  # before the exception reaches the training loop
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

    Peak device memory is read every ``memory_every`` steps from torch's allocator (CUDA,
    ROCm, XPU; nothing on CPU); ``memory_source`` replaces that source (tests inject a
    fake one, see ``trainer_hook.memory``), ``None`` turns it off. An out-of-memory error
    inside ``hook.step()`` is reported to the backend, and flushed, before it propagates.

    ``dp_mesh``: for a device-mesh job, the DeviceMesh of its data-parallel dimensions
    (``mesh["dp"]`` for DP x TP, the whole 2-D mesh for HSDP). Shares are then per
    data-parallel replica: ``rank`` is this rank's replica index, ``world_size`` the number
    of replicas, every rank of a replica reads the same samples, and only each replica's
    first rank talks to the backend, reporting its replica's pace: per step the slowest
    member's times, combined off the training thread every 8 steps (docs/meshes.md). Example::

        mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan); fully_shard(model, mesh=mesh["dp"])
        hook = RebalanceHook(global_batch_size=64, dp_mesh=mesh["dp"])
        hook.attach(model)
    """

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
        self._mesh: MeshShape | None = None  # the job's mesh shape, for the hello
        self._pace: ReplicaPace | None = None  # combines the replica's records (members > 1)
        # The lookahead in force: given, or measured at the first step (None until then).
        self._lookahead: int | None = cfg.lookahead if isinstance(cfg.lookahead, int) else None
        self._known_lookahead = 0  # what hook.data_loader() knows its loader needs
        self._agree_at = 0  # the batch index at which to measure and agree on it
        self._grads = GradientState()
        self._timer = StepTimer()
        source = default_memory_source() if memory_source is _AUTO else memory_source
        self._memory: MemoryMeter | None = (
            MemoryMeter(source, every=cfg.memory_every) if source is not None else None)
        self._mem_pending: MemoryReading | None = None
        self._ctx = _StepContext(self)
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
        self.history: deque[StepRecord] = deque(maxlen=cfg.history)
        self.acks: list[tuple[int, int]] = []
        self.rejections: list[tuple[int, str]] = []
        self.last_error: Error | None = None
        self._initial: PendingPlacement | None = None
        self._initial_event = threading.Event()
        self._transport: Any = None
        self._probe: Any = None
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
            replicas = replica_of(self._dp_mesh)
            self._rank, self._world_size, self._replica_ranks = replicas.replica, replicas.replicas, replicas.members
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
        self._control = ControlChannel(
            rank=0 if self._root else 1 + self._rank, world_size=self._world_size, schedule=self._schedule,
            exchange_every=cfg.exchange_every, exchange_lag=cfg.exchange_lag,
            lookahead=lookahead, group=group,
        )
        if replicas is not None and self._members > 1:
            # The replica's own gloo group, where its members' step times meet. Created by
            # its members only (local synchronisation): no world-wide barrier per replica.
            mine = dist.new_group(list(replicas.members), backend="gloo", use_local_synchronization=True)
            self._pace = ReplicaPace(mine, leader=leader, report=self._report_many)
        self._trained: ScheduledPlacement = self._schedule.at(0)
        self._ready = True
        if not cfg.offline and leader:  # only a replica's leader talks to the backend
            self._start_io()
        _lifecycle.track(self)  # after init_process_group: its atexit runs before torch's

    @property
    def schedule(self) -> PlacementSchedule:
        """Which placement is in force for each batch index (shared by sampler and step)."""
        self._init_distributed("hook.schedule")
        return self._schedule

    # --- public read-only state ------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank (0 without a process group)."""
        self._init_distributed("hook.rank")
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks (1 without a process group)."""
        self._init_distributed("hook.world_size")
        return self._world_size

    @property
    def lookahead(self) -> int | None:
        """Batches a new placement's start leaves for the loader's prefetch.

        The ``lookahead`` given to the hook, or the one measured at the first step (the
        largest over ranks of how far the loader had asked the sampler ahead, plus one);
        before that, what ``hook.data_loader`` knows its loader needs, else None.
        """
        if self._lookahead is not None:
            return self._lookahead
        return self._known_lookahead or None

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
        self._init_distributed("hook.placement")
        return self._trained

    @property
    def placement_version(self) -> int:
        return self.placement.version

    @property
    def shares(self) -> list[int]:
        return list(self.placement.shares)

    @property
    def last_step(self) -> StepRecord | None:
        """The newest StepRecord of this rank, or None before the first step ends. With
        ``dp_mesh``, a replica leader's records are its replica's (the slowest member's
        times), which arrive up to two windows of 8 steps late (docs/meshes.md)."""
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

    def attach(self, model: torch.nn.Module, *, gradients: str = "auto") -> torch.nn.Module:
        """Make gradients the global-batch mean whatever the split; returns ``model``.

        ``gradients="auto"`` (default; ``"comm_hook"`` means the same) picks the
        mechanism from the wrapper, and ``hook.gradients`` says which:

        - DistributedDataParallel: a comm hook multiplies each bucket by this rank's
          share of the batch and all-reduces with SUM (``"ddp_comm_hook"``);
        - FSDP2 (``fully_shard``, recognised through ``FSDPModule`` whatever the
          dynamically made class is called): a custom reduce-scatter weights the
          gradients the same way, with FSDP's divide factor set to 1
          (``"fsdp2_reduce_scatter"``);
        - FSDP1 (``FullyShardedDataParallel``): its comm hook, the same weighting
          (``"fsdp1_comm_hook"``);
        - one process, a plain module: nothing to weight (``"local"``).

        Nothing else is needed in the loop. ``gradients="loss_scale"`` registers no
        communication: back-propagate ``loss * hook.loss_weight()`` and let the
        framework's averaging all-reduce do the rest (where another library owns DDP's
        comm hook). Any other model with several ranks is refused with a message saying
        to do exactly that. DeepSpeed, pipeline parallelism, tensor parallelism and
        HSDP are refused, naming what is supported; so is any device mesh the hook cannot
        balance (DTensor parameters over a tensor/context-parallel dim, FSDP2 over a
        sub-mesh, DDP or FSDP1 over a sub-group) unless the hook was given ``dp_mesh``;
        with it, FSDP2 over ``dp_mesh`` (1-D, or 2-D for HSDP, with or without TP) and
        DDP over its group are weighted per replica, and a model whose mesh disagrees
        with ``dp_mesh`` is refused naming both.

        Gradient accumulation: all micro-batches of one global batch inside one
        ``hook.step()``, gradient sync off for all but the last (``model.no_sync()``, or
        FSDP2's ``set_requires_gradient_sync(False)``), each loss the micro-batch's part
        of the mean over the rank's whole local batch; with DDP a second all-reduce
        inside one step raises at its end. Example::

            model = fully_shard(model)                  # or DDP(model), FSDP(model)
            hook.attach(model)
            for x, y in hook.data_loader(ds, num_workers=4):
                with hook.step():
                    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        """
        if gradients not in _GRADIENT_MODES:
            raise ValueError(f"gradients must be one of {_GRADIENT_MODES}, got {gradients!r}.")
        self._init_distributed("hook.attach()")
        if self._gradients_mode is not None:
            raise RuntimeError("attach() was already called on this hook; call it once per model.")
        if gradients == "loss_scale":
            check_data_parallel(model, self._world_size, dp_mesh=self._dp_mesh)
            self._grad_handles = register_grad_timer(model, self._grads)
            mode = "loss_scale"
        else:
            mode = register_gradient_weighting(model, self._grads, self._world_size, dp_mesh=self._dp_mesh)
            if mode == "local":
                self._grad_handles = register_grad_timer(model, self._grads)
        # FSDP's parameter all-gathers are waits for peers on either path.
        self._grad_handles += register_unshard_timer(model, self._grads)
        self._gradients_mode = mode
        if self._transport is not None and mode in _COMM_KIND:
            # The hello sent on connecting (at the top of attach) could not name the collective yet.
            self._transport.send_control(self._hello())
        # A drained rank trains a one-sample dummy batch (weight 0); batch norm would fold
        # it into its running statistics (and BatchNorm1d refuses one sample in training).
        # SyncBatchNorm is left alone: in eval it would skip its collective and hang peers.
        self._norms = [
            m for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            and not isinstance(m, torch.nn.SyncBatchNorm)
        ]
        self._ensure_started()
        return model

    @property
    def gradients(self) -> str | None:
        """The gradient mechanism ``attach`` chose (None before ``attach``)."""
        return self._gradients_mode

    def data_loader(
        self,
        dataset: Sized,
        *,
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        sample_cost: SampleCost | None = None,
        sample_length: SampleCost | None = None,
        **loader_kwargs: Any,
    ) -> DataLoader[Any]:
        """A ``DataLoader`` over ``batch_sampler(dataset, shuffle, seed, drop_last,
        sample_cost, sample_length)``.

        Every other ``DataLoader`` argument passes through (``num_workers``,
        ``prefetch_factor``, ``persistent_workers``, ``pin_memory``, ``collate_fn``, ...).
        The hook knows how far this loader prefetches, so ``hook.lookahead`` is right
        before the first step, and ``loader.sampler.set_epoch(epoch)`` works as in the DDP
        tutorial (the epoch follows the batch index; the call changes nothing). Example::

            loader = hook.data_loader(ds, shuffle=True, seed=0, num_workers=4, pin_memory=True)
            for epoch in range(epochs):
                loader.sampler.set_epoch(epoch)
                for x, y in loader:
                    with hook.step():
                        ...

        ``batch_size`` may only repeat the hook's ``global_batch_size`` (each rank's batch
        is its share of it); ``sampler`` and ``batch_sampler`` are the hook's.
        """
        from trainer_hook.loader import HookDataLoader

        b = self.config.global_batch_size
        if batch_size is not None and batch_size != b:
            raise ValueError(
                f"data_loader(batch_size={batch_size}) differs from the hook's global_batch_size "
                f"({b}): every rank's batch is its share of the global batch. Leave batch_size "
                f"out, or create the hook with RebalanceHook(global_batch_size={batch_size})."
            )
        clash = sorted(k for k in ("sampler", "batch_sampler") if k in loader_kwargs)
        if clash:
            raise ValueError(
                f"data_loader() does not take {clash}: the hook's batch_sampler decides every "
                "rank's batch. Pass shuffle=, seed= and drop_last= instead."
            )
        workers = int(loader_kwargs.get("num_workers", 0) or 0)
        depth = workers * int(loader_kwargs.get("prefetch_factor") or 2) if workers > 0 else 0
        if isinstance(self.config.lookahead, int) and self.config.lookahead < depth + 1:
            raise ValueError(
                f"lookahead={self.config.lookahead} is too short for this loader, which prefetches "
                f"{depth} batches: use lookahead={depth + 1} or leave lookahead out (measured)."
            )
        sampler = self.batch_sampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                     sample_cost=sample_cost, sample_length=sample_length)
        loader = HookDataLoader(dataset, sampler, **loader_kwargs)
        self._known_lookahead = max(self._known_lookahead, depth + 1)
        return loader

    def batch_sampler(
        self,
        dataset: Sized | int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        sample_cost: SampleCost | None = None,
        sample_length: SampleCost | None = None,
    ) -> RebalanceBatchSampler:
        """This rank's batch sampler: pass it to ``DataLoader(batch_sampler=...)``.

        Global batch k is the same samples on every rank and under every placement; the
        sampler yields this rank's contiguous slice of it. Works with ``num_workers > 0``
        as long as the loader prefetches at most ``lookahead`` batches. A drained rank
        (share 0) gets a one-sample dummy batch whose gradient weight is 0. Each
        ``iter()`` starts at ``hook.batch_index``, so breaking out of an epoch and looping
        again continues with the next untrained batch. The hook takes the batch sizes of
        an epoch's short last batch from the sampler created last.

        ``sample_cost`` makes the split balance work instead of samples when samples differ
        in cost (variable-length sequences): a sequence with one number >= 0 per dataset
        index (token counts, say) or a callable ``index -> number``. The placement's shares
        are then shares of each batch's work; the samples of batch k go to ranks by a
        longest-processing-time-first partition every rank computes alike, so batch k is
        still the same samples, each trained once. Every rank must pass the same costs::

            lengths = [len(ex["input_ids"]) for ex in ds]
            loader = hook.data_loader(ds, shuffle=True, seed=0, sample_cost=lengths)

        ``sample_length`` (instead of ``sample_cost``, in the same forms) gives each sample's
        length where its cost grows faster than its length (attention): the backend fits
        ``time = c + a*sum(L) + b*sum(L^2)`` per rank from the step times and, where that
        explains them better than the length alone, the split weighs a sample as ``L +
        (b/a)*L^2`` (the placement's ``length_sq_weight``); until then, as its length. The
        job view says which cost model is in use and how well it fits::

            loader = hook.data_loader(ds, shuffle=True, seed=0, sample_length=lengths)
        """
        self._init_distributed("hook.batch_sampler()")
        sampler = RebalanceBatchSampler(
            dataset, schedule=self._schedule, rank=self._rank, shuffle=shuffle, seed=seed,
            drop_last=drop_last, position=lambda: self._next_batch, before_iter=self._ensure_started,
            sample_cost=sample_cost, sample_length=sample_length,
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

    def token_loss_weight(self, n_valid: int | torch.Tensor) -> float | torch.Tensor:
        """Factor that turns this rank's summed token loss into its part of the global token mean.

        ``n_valid`` is the number of valid tokens (labels not equal to the ignore index) in
        this rank's local batch of the step being trained; with gradient accumulation, over
        all of the step's micro-batches. The global count is all-reduced (SUM) over the
        data-parallel ranks: one scalar, on the device of ``n_valid`` when it is a device
        tensor (no host sync; the result is then a float64 tensor), else on the hook's CPU
        group (the result is a float). The factor also undoes whatever gradient weighting
        ``attach`` set up for this split (the DDP comm hook's ``share / B``, the loss-scaling
        path's average over ranks), so parameters follow the mean loss over all valid
        tokens of the global batch, however the batch is split. A rank with no valid
        tokens gets 0, and a drained rank's dummy batch counts none. Call it inside ``with hook.step():``,
        once per step. Example::

            with hook.step():
                logits = model(input_ids)
                loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                           ignore_index=-100, reduction="sum")
                n_valid = (labels != -100).sum()
                (loss_sum * hook.token_loss_weight(n_valid)).backward()
                opt.step(); opt.zero_grad()
        """
        scale = self._token_scale()
        if isinstance(n_valid, torch.Tensor):
            if n_valid.numel() != 1 or n_valid.is_floating_point() and not torch.isfinite(n_valid).all():
                raise ValueError(
                    f"token_loss_weight expects this rank's count of valid tokens (one number), got a "
                    f"tensor of shape {tuple(n_valid.shape)}; pass (labels != ignore_index).sum()."
                )
            total = n_valid.detach().reshape(()).to(torch.float64)
            if self._grads.weight == 0:  # a dummy batch: its tokens are not the global batch's
                total = torch.zeros_like(total)
            if self._world_size > 1:
                group = self._control.group if total.device.type == "cpu" else None
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
                if self._members > 1:  # every member of a replica counted the same tokens
                    total = total / self._members
            # 0 valid tokens in the whole batch: nothing to learn, and no division by zero.
            return torch.where(total > 0, scale / total.clamp_min(1.0), torch.zeros_like(total))
        if isinstance(n_valid, bool) or not isinstance(n_valid, int) or n_valid < 0:
            raise ValueError(
                f"token_loss_weight expects this rank's count of valid tokens, an integer >= 0 (or a "
                f"one-element tensor), got {n_valid!r}."
            )
        count = float(n_valid) if self._grads.weight > 0 else 0.0  # a dummy batch counts nothing
        if self._world_size > 1:
            buf = torch.tensor([count], dtype=torch.float64)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self._control.group)
            count = float(buf[0]) / self._members  # every member of a replica counted the same tokens
        return scale / count if count > 0 else 0.0

    def _token_scale(self) -> float:
        """1 over the gradient scale attach() applies to this rank's loss after backward."""
        mode, w = self._gradients_mode, self._grads.weight
        if w <= 0:  # a dummy batch: its loss must not reach the gradients on any path
            return 0.0
        if mode in ("ddp_comm_hook", "fsdp2_reduce_scatter", "fsdp1_comm_hook"):
            return 1.0 / w
        if mode == "local":
            return 1.0
        return float(self._world_size)  # the wrapper averages over ranks (loss_scale, or no attach)

    def _begin_step(self) -> int:
        if self._closed:
            if self._forked:
                raise RuntimeError(
                    "This RebalanceHook belongs to the parent process; a forked child (a DataLoader "
                    "worker) must not train with it. Create hooks in the training process only."
                )
            raise RuntimeError("This RebalanceHook is closed; create a new one to train further.")
        if not self._started:
            self._ensure_started()
        k = self._next_batch
        control = self._control
        if self._lookahead is None:
            self._agree_lookahead(k)
            if self._lookahead is None:  # postponed: no exchange may start a placement yet
                control = _NO_EXCHANGE
        if k >= control.due:  # an exchange to collect or launch; otherwise nothing to do
            control.on_step(k)
        p = self._schedule.at(k)
        sampler = self._sampler
        b = self.config.global_batch_size
        if sampler is not None and sampler.has_cost:  # a cost partition: the count varies per batch
            local = sampler.local_size(k)
            weight = local / sampler.batch_length(k)
        elif sampler is None or sampler.batch_length(k) == b:
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
        if local == 0 and self._norms:
            self._freeze_norms()
        if p.version != self._trained_version:
            self._on_new_version(p, k)
        self._trained = p
        if self._memory is not None:
            self._memory.begin(local)
        self._timer.start(k, local, p.version, events=grads.events)
        return k

    def _agree_lookahead(self, k: int) -> None:
        """How far the loader asks the sampler ahead of training, agreed across ranks.

        At the first step, one blocking all-reduce (MAX) on the control group of
        ``[ahead + 1, truncated]``. Every batch asked for so far is at most ``k +
        lookahead - 1``, and the first exchange's placement starts at ``k + lag +
        lookahead`` or later, so nothing a loader holds can change. A loader can only run
        ahead to the end of its epoch; when a run starts (resumes) so near the end that
        the sampler ran out, the measure is short, so it is taken again at the first
        step of the next epoch, with no exchange before (placements wait, a few steps).
        """
        if k < self._agree_at:
            return
        sampler = self._sampler
        ahead, truncated = 0, 0
        if sampler is not None:
            ahead = sampler.furthest - k
            per_epoch = len(sampler)
            epoch_end = (k // per_epoch + 1) * per_epoch - 1
            truncated = int(sampler.furthest >= epoch_end and k % per_epoch != 0 and self._agree_at == 0)
        lookahead = max(1, ahead + 1, self._known_lookahead)
        group = self._control.group
        if group is not None:
            buf = torch.tensor([lookahead, truncated], dtype=torch.int64)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
            lookahead, truncated = (int(v) for v in buf.tolist())
        if truncated and sampler is not None:
            self._agree_at = (k // len(sampler) + 1) * len(sampler)
            return
        self._lookahead = lookahead
        self._control.set_lookahead(k, lookahead)

    def _freeze_norms(self) -> None:
        # Eval mode for the dummy step: normalise with the running statistics, update none.
        self._frozen = [m for m in self._norms if m.training]
        for m in self._frozen:
            m.train(False)

    def _end_step(self, *, failed: bool) -> None:
        if self._frozen:
            for m in self._frozen:
                m.train(True)
            self._frozen = []
        self._grads.collect()
        rec = self._timer.finish(self._grads)
        if failed:
            return
        self._next_batch += 1
        if self._memory is not None:
            reading = self._memory.end()
            if reading is not None:
                self._mem_pending = reading
            pending = self._mem_pending
            # On CUDA the record comes a step or more late: it carries the reading when it
            # trained at the same local batch size (a newer reading replaces one that waits).
            if pending is not None and rec is not None and rec.local_batch_size == pending.local_batch_size:
                rec.mem_peak_bytes, rec.mem_reserved_bytes, rec.mem_total_bytes = pending[1:]
                self._mem_pending = None
        sampler = self._sampler
        if rec is not None and sampler is not None and sampler.has_cost:
            rec.work = sampler.local_work(rec.batch_index) if rec.local_batch_size else 0.0
            rec.batch_work = sampler.batch_work(rec.batch_index)
            sq = sampler.local_work_sq(rec.batch_index)
            if sq is not None:
                rec.work_sq = sq[0] if rec.local_batch_size else 0.0
                rec.batch_work_sq = sq[1]
        pace = self._pace
        if pace is not None:  # the leader reports its replica's pace (the slowest member's times)
            if rec is not None:
                if not pace.leader:
                    self.history.append(rec)  # a member keeps its own; the leader sends
                for r in pace.add(rec):  # only a record whose window left already
                    self._report(r)
            pace.on_step_end(self._next_batch, self._grads.events is not None)
        elif rec is not None:
            self._report(rec)
        if self._grads.repeated_bucket:
            raise RuntimeError(
                "Gradients were all-reduced more than once in one hook.step(): gradient "
                "accumulation must wrap every micro-batch but the last in model.no_sync(), "
                "otherwise each micro-batch is weighted as a whole batch and the math changes."
            )

    def _report(self, rec: StepRecord) -> None:
        self.history.append(rec)
        if self._transport is not None:
            self._transport.put_step(rec)

    def _report_many(self, recs: Sequence[StepRecord]) -> None:
        """The pace thread: a replica's combined records (deque appends are thread-safe)."""
        for rec in recs:
            self._report(rec)

    def _report_oom(self, exc: BaseException) -> None:
        """Tell the backend this rank ran out of memory, and wait (up to 2 s) until the
        message left: the process is about to die with the job."""
        try:
            k, local, version = self._timer._meta
            meter = self._memory
            oom = Oom(job=self.config.job_name, rank=self._rank, version=version, batch_index=k,
                      local_batch_size=local, mem_peak_bytes=meter.peak_now() if meter else None,
                      mem_total_bytes=meter.source.total_bytes() if meter else None,
                      message=str(exc)[:2000])
            log.error("rank %d ran out of memory at batch %d with %d samples (placement %d); "
                      "reporting it to the backend", self._rank, k, local, version)
            if self._transport is not None:
                self._transport.send_control(oom)
                if not self._transport.flush_control(_OOM_FLUSH_S):
                    log.warning("the out-of-memory report could not be sent within %.0f s", _OOM_FLUSH_S)
        except Exception:  # noqa: BLE001 - never mask the out-of-memory error itself
            log.exception("reporting the out-of-memory error failed")

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
        self._init_distributed("hook.request_placement()")
        if not self._root:
            raise RuntimeError(
                f"request_placement() was called on rank {self._rank}; only rank 0 decides "
                "placements. Call it on rank 0 (the others learn it at the next exchange)."
            )
        with self._lock:
            if version is None:
                pending = self._control.pending
                version = 1 + max(self._schedule.latest.version, pending.version if pending else 0)
        error = self._offer(version, shares, reason, self.config.global_batch_size)
        if error is not None:
            raise ValueError(error)
        return version

    def _offer(self, version: int, shares: Any, reason: str, global_batch_size: int,
               length_sq_weight: float = 0.0) -> str | None:
        """Validate and queue a placement; on failure record and report a reject."""
        error: str | None = None
        checked: list[int] = []
        with self._lock:
            latest = self._schedule.latest
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
                    if (self._members > 1 and isinstance(shares, (list, tuple))
                            and len(shares) == self._world_size * self._members):
                        error = (
                            f"placement version {version} is invalid: it has one share per rank "
                            f"({len(shares)}), but with dp_mesh shares are per data-parallel replica: "
                            f"this job has {self._world_size} replicas of {self._members} ranks each; "
                            f"give {self._world_size} shares."
                        )
            if error is None and version <= newest:
                known = pending if pending is not None and pending.version == version else None
                if version == latest.version and tuple(checked) == latest.shares:
                    return None  # the placement in force again (a reconnect's hello reply)
                if known is not None and known.shares == tuple(checked):
                    return None
                error = f"placement version {version} is not newer than version {newest} already in force or pending."
            if error is None:
                self._control.offer(PendingPlacement(version, tuple(checked), reason, length_sq_weight))
                return None
        self.rejections.append((version, error))
        log.warning("rejected placement: %s", error)
        if self._transport is not None:
            self._transport.send_control(Reject(job=self.config.job_name, rank=self._rank, version=version, reason=error))
        return error

    def _on_message(self, msg: Message) -> None:
        """Transport thread: a backend ``placement`` (rank 0 acts on it) or ``error``."""
        if isinstance(msg, Placement):
            if not self._root:
                return  # rank 0 decides for everyone; the exchange brings it here
            with self._lock:
                startup = not self._started
            if startup:
                self._initial = PendingPlacement(msg.version, tuple(msg.shares), msg.reason,
                                                 msg.length_sq_weight)
                self._initial_event.set()
                return
            self._offer(msg.version, msg.shares, msg.reason, msg.global_batch_size, msg.length_sq_weight)
        elif isinstance(msg, Error):
            self.last_error = msg
            log.warning("backend error %s: %s", msg.code, msg.message)

    def _ensure_started(self) -> None:
        """Once, on every rank: resume the placement in force (rank 0's view) before batch 0."""
        if self._started:
            return
        self._init_distributed("the first batch")
        version: int | None = None
        shares: list[int] | None = None
        length_sq_weight = 0.0
        if self._root and self._transport is not None:
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
                    length_sq_weight = initial.length_sq_weight
                except ValueError as exc:
                    self._reject(initial.version, f"placement version {initial.version} is invalid: {exc}")
        if version is not None and version <= self._schedule.latest.version:
            version = shares = None  # a resumed checkpoint's placement is as new or newer
        if not self.config.offline:
            self._control.sync_initial(version, shares, length_sq_weight)
        with self._lock:
            self._started = True
            self._trained = self._schedule.at(self._next_batch)
            late, self._initial = self._initial, None
        if late is not None:  # arrived after the wait: takes the ordinary path
            self._offer(late.version, list(late.shares), late.reason, self.config.global_batch_size)

    def _reject(self, version: int, reason: str) -> None:
        self.rejections.append((version, reason))
        log.warning("rejected placement: %s", reason)
        if self._transport is not None:
            self._transport.send_control(Reject(job=self.config.job_name, rank=self._rank, version=version, reason=reason))

    # --- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the run stands, for a checkpoint: plain ints and lists (JSON-safe).

        ``batch_index`` (the next untrained global batch), the placement in force for it
        and its version, a newer placement already agreed or pending (``next_placement``),
        and the epoch position. Save it with the model and optimizer; every rank holds
        the same. Example::

            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "rebalancer": hook.state_dict()}, path)
        """
        self._init_distributed("hook.state_dict()")
        k = self._next_batch
        current = self._schedule.at(k)
        nxt = self._schedule.latest
        pending = self._control.undelivered if self._root else None
        upcoming = pending if pending is not None and pending.version > nxt.version else nxt
        sampler = self._sampler
        return {
            "format": _STATE_FORMAT,
            "batch_index": k,
            "global_batch_size": self.config.global_batch_size,
            "world_size": self._world_size,
            "placement": {"version": current.version, "shares": list(current.shares)},
            "next_placement": (
                {"version": upcoming.version, "shares": list(upcoming.shares)}
                if upcoming.version > current.version else None
            ),
            "epoch": k // len(sampler) if sampler is not None else None,
            "batches_per_epoch": len(sampler) if sampler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next step trains ``batch_index`` under the
        placement it had (or a newer one the backend holds), and the loader's sampler
        starts there, in the right epoch of the seeded order.

        Call it on every rank (rank 0's copy is used), after ``attach`` and before the
        loader is first iterated. Raises ValueError for a state of another job shape
        (global batch size) or out-of-range numbers; a different world size keeps the
        batch index and starts from the uniform split.
        """
        self._init_distributed("hook.load_state_dict()")
        sampler = self._sampler
        if self._next_batch != 0 or self.history or (sampler is not None and sampler.furthest >= 0):
            raise RuntimeError(
                "load_state_dict() must come before the first batch is drawn: call it right "
                "after building the model, optimizer and loader, before iterating the loader."
            )
        k, version, shares, nxt = _check_state(state, self.config.global_batch_size, self._world_size)
        group = self._control.group
        if group is not None:  # rank 0's copy decides, so ranks cannot disagree
            w = self._world_size
            buf = torch.full((2 + w,), -1, dtype=torch.int64)
            if self._root:
                buf[0], buf[1] = k, version if shares is not None else -1
                if shares is not None:
                    buf[2:] = torch.tensor(shares, dtype=torch.int64)
            dist.broadcast(buf, src=0, group=group)
            values = buf.tolist()
            k, version = values[0], values[1]
            shares = values[2:] if version >= 0 else None
        if self._lookahead is not None:  # given: settle from the resumed batch on
            self._control.set_lookahead(k, self._lookahead)
        with self._lock:
            if shares is not None and version > self._schedule.latest.version:
                self._schedule.replace_initial(version, shares)
            self._next_batch = k
            self._trained = self._schedule.at(k)
        if nxt is not None and self._root and nxt[0] > self._schedule.latest.version:
            self._control.offer(PendingPlacement(nxt[0], tuple(nxt[1]), "resumed from a checkpoint"))

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
        )

    def close(self, *, wait_for_peers: bool = True) -> None:
        """Finish the exchange in flight, flush metrics, stop the threads. Idempotent.

        Every rank must call it after the same number of steps. ``wait_for_peers=False``
        skips waiting on the exchange in flight (shutting down on a signal, when peers
        may be gone). It may come before or after ``dist.destroy_process_group()``; a hook
        never closed is closed at interpreter exit. In a forked child (a DataLoader
        worker) the hook is already inert and this does nothing.
        """
        self._close(wait_for_peers=wait_for_peers, wait_timeout_s=None)

    def _close(self, *, wait_for_peers: bool, wait_timeout_s: float | None) -> None:
        if self._closed:
            return
        self._closed = True
        _lifecycle.forget(self)  # nothing left for the exit handler
        if not self._ready:
            return  # never used: no group, no threads
        try:
            if wait_for_peers:
                self._control.close(timeout_s=wait_timeout_s)
            if self._pace is not None:  # the records of the last window(s), combined if peers wait
                pace = self._pace
                for r in pace.flush(self._next_batch, wait_timeout_s) if wait_for_peers else pace.release():
                    self._report(r)  # held by the leader only
        finally:
            self._release_process_groups()
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
        self._grads._pg = None
        self._grads._opts = None
        self._control.after_fork_in_child()
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
        group, self._control.group = self._control.group, None
        pace_group = None
        if self._pace is not None:
            pace_group, self._pace.group = self._pace.group, None
        for g in (group, pace_group):
            if g is not None and dist.is_available() and dist.is_initialized():
                try:
                    dist.destroy_process_group(g)
                except (RuntimeError, ValueError) as exc:  # already gone with the default group
                    log.debug("control group was already destroyed: %s", exc)

    def __enter__(self) -> RebalanceHook:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_STATE_FORMAT = 1


class _NoExchange:
    """Stands in for the control channel while the lookahead is not agreed yet."""

    due = 1 << 62

    def on_step(self, batch_index: int) -> None:  # never reached: due is unreachable
        pass


_NO_EXCHANGE: Any = _NoExchange()


def _check_state(
    state: Any, global_batch_size: int, world_size: int
) -> tuple[int, int, list[int] | None, tuple[int, list[int]] | None]:
    """(batch_index, version, shares or None, next placement or None) from a state_dict."""
    if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
        raise ValueError(f"not a RebalanceHook state_dict (format {_STATE_FORMAT}): got {type(state).__name__}.")
    k = state.get("batch_index")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < (1 << 62):
        raise ValueError(f"state_dict batch_index must be an integer in [0, 2**62), got {k!r}.")
    if state.get("global_batch_size") != global_batch_size:
        raise ValueError(
            f"state_dict is for global_batch_size {state.get('global_batch_size')!r}, but this hook "
            f"trains with {global_batch_size}: resume with the same global batch size."
        )
    if state.get("world_size") != world_size:
        log.warning(
            "state_dict was saved with world size %r, this run has %d: resuming at batch %d "
            "with the uniform split.", state.get("world_size"), world_size, k,
        )
        return k, 0, None, None

    def placement(entry: Any) -> tuple[int, list[int]] | None:
        if entry is None:
            return None
        if not isinstance(entry, dict):
            raise ValueError(f"state_dict placement must be a dict with version and shares, got {entry!r}.")
        v = entry.get("version")
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < (1 << 62):
            raise ValueError(f"state_dict placement version must be an integer >= 0, got {v!r}.")
        raw: Any = entry.get("shares")
        if not isinstance(raw, list):
            raise ValueError(f"state_dict placement shares must be a list, got {raw!r}.")
        return v, check_shares(raw, world_size=world_size, global_batch_size=global_batch_size)

    current = placement(state.get("placement"))
    if current is None:
        raise ValueError("state_dict has no placement.")
    return k, current[0], current[1], placement(state.get("next_placement"))


_UNMEASURED = 1 << 40  # lookahead before the first step measures it: nothing is final yet


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

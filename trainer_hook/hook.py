"""RebalanceHook: the public API, a thin facade over the hook's components.

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

The hook holds what exists from its constructor on (config, Connection, gradient state,
timers) and, once the process group is there, the Components that trainer_hook._wiring
builds: StepLoop, Placements, Weighting, Loading, Checkpoints, MicroSteps. Each method
here forwards to one of them; its lifecycle (close, at exit, in a forked child) calls
each in turn.

One module, over 400 lines on purpose: the whole public API in one place, each method a
short forward to a component beside its full docstring and example.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence, Sized
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader

from rebalancer_wire.protocol import Error, Hello, Message, StepRecord
from trainer_hook import _lifecycle
from trainer_hook._checkpoint import checkpointing
from trainer_hook._connection import HOOK_VERSION as HOOK_VERSION  # re-exported: zero_code reads it
from trainer_hook._connection import Connection
from trainer_hook._loading import check_loader_args
from trainer_hook._micro_steps import ValidTokens
from trainer_hook._placements import check_length_sq_weight as check_length_sq_weight
from trainer_hook._ranks import env_world_size
from trainer_hook._steps import StepContext, refuse_closed
from trainer_hook._weights import GRADIENT_MODES
from trainer_hook._wiring import Before, Components, build, close_groups
from trainer_hook.config import HookConfig, check_total_steps
from trainer_hook.gradients import GradientState
from trainer_hook.memory import MemoryMeter, MemorySource, default_memory_source
from trainer_hook.microbatch import MicroBatches
from trainer_hook.phases import GcSchedule, PhaseClock
from trainer_hook.pipeline import PipelineRun, PipelineSchedules
from trainer_hook.placement import PlacementSchedule, ScheduledPlacement
from trainer_hook.sampler import RebalanceBatchSampler, SampleCost
from trainer_hook.timing import StepTimer

__all__ = ["RebalanceHook"]

# How long close() at interpreter exit waits for the exchange in flight: every rank
# launched it, so it is normally complete; a peer stuck elsewhere must not hold the exit.
_EXIT_WAIT_S = 30.0
_AUTO: Any = object()
# attach()'s argument: a model, or an interleaved pipeline rank's stage modules.
_Attached = TypeVar("_Attached", torch.nn.Module, Sequence[torch.nn.Module])


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

    Streams and fixed shapes: with ``micro_batches=M`` a share counts fixed-shape
    micro-batches, which ``hook.micro_batches(stream)`` yields inside ``hook.step()``
    (no sampler; see that method and docs/streaming.md).

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

    ``pp_mesh`` (with ``dp_mesh`` and ``micro_batches=M``): a PP x DP job; each data-parallel
    replica is a pipeline, its share a number of micro-batches, and every step runs
    ``hook.pipeline_schedule(...)`` (docs/pipelines.md).
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
        pp_mesh: Any = None,
        **config: Any,
    ) -> None:
        self.config = HookConfig.from_env(
            server=server, job=job, global_batch_size=global_batch_size, token=token, **config
        )
        cfg = self.config
        self._grads = GradientState()
        self._phases = PhaseClock()  # GC pauses, loader and checkpoint time of each step
        self._phases.install()
        self._timer = StepTimer(phases=self._phases)
        gcs = GcSchedule(freeze=cfg.gc_freeze, every=cfg.gc_collect_every)
        source = default_memory_source() if memory_source is _AUTO else memory_source
        self._conn = Connection(cfg)
        # pp_mesh: each data-parallel replica is a pipeline; shares count its micro-batches.
        self._pipeline = PipelineSchedules(pp_mesh, self._grads) if pp_mesh is not None else None
        self._before = Before(
            config=cfg, dp_mesh=dp_mesh, connection=self._conn, grads=self._grads, phases=self._phases,
            timer=self._timer, gc_schedule=gcs if gcs.active else None,  # None: Python's own
            memory=MemoryMeter(source, every=cfg.memory_every) if source is not None else None,
            training_thread=threading.get_ident(),  # whose stack a hang report carries
            pipeline=self._pipeline,
        )
        self._c: Components | None = None  # built once the process group is there
        self._ctx = StepContext(_Unwired(self))
        self._closed = False
        self._forked = False
        # Created before the process group (HF TrainingArguments and Accelerate's
        # Accelerator make it): the rest waits for the first use.
        if (torch.distributed.is_available() and torch.distributed.is_initialized()) or env_world_size() <= 1:
            self._init_distributed("RebalanceHook()")

    def _init_distributed(self, where: str) -> Components:
        """Once: the components (trainer_hook._wiring), on the process group."""
        c = self._c
        if c is None:
            c = self._c = build(self._before, where)
            self._ctx.steps = c.loop
            _lifecycle.track(self)  # after init_process_group: its atexit runs before torch's
        return c

    def _ensure_started(self) -> None:
        self._init_distributed("the first batch").ensure_started()

    # --- public read-only state ------------------------------------------------------

    @property
    def schedule(self) -> PlacementSchedule:
        """Which placement is in force for each batch index (shared by sampler and step)."""
        return self._init_distributed("hook.schedule").schedule

    @property
    def rank(self) -> int:
        """This process's rank (0 without a process group)."""
        return self._init_distributed("hook.rank").ranks.rank

    @property
    def world_size(self) -> int:
        """Number of ranks (1 without a process group)."""
        return self._init_distributed("hook.world_size").ranks.world_size

    @property
    def lookahead(self) -> int | None:
        """Batches a new placement's start leaves for the loader's prefetch.

        The ``lookahead`` given to the hook, or the one measured at the first step (the
        largest over ranks of how far the loader had asked the sampler ahead, plus one);
        before that, what ``hook.data_loader`` knows its loader needs, else None.
        """
        c = self._c
        if c is None:
            la = self.config.lookahead
            return la if isinstance(la, int) else None
        if c.loop.lookahead is not None:
            return c.loop.lookahead
        return c.loop.known_lookahead or None

    @property
    def global_batch_size(self) -> int:
        return self.config.global_batch_size

    @property
    def batch_index(self) -> int:
        """The global batch index the next ``step()`` trains (counts across epochs)."""
        return self._c.loop.next_batch if self._c is not None else 0

    @property
    def placement(self) -> ScheduledPlacement:
        """The placement of the batch trained last (version 0 before the first step)."""
        return self._init_distributed("hook.placement").placements.trained

    @property
    def placement_version(self) -> int:
        return self.placement.version

    @property
    def shares(self) -> list[int]:
        return list(self.placement.shares)

    @property
    def history(self) -> deque[StepRecord]:
        """This rank's newest StepRecords (``history`` of them, oldest first)."""
        return self._conn.history

    @property
    def acks(self) -> list[tuple[int, int]]:
        """(version, batch index) of each placement this rank switched to."""
        return self._c.placements.acks if self._c is not None else []

    @property
    def rejections(self) -> list[tuple[int, str]]:
        """(version, reason) of each placement this rank refused."""
        return self._c.placements.rejections if self._c is not None else []

    @property
    def last_error(self) -> Error | None:
        """The backend's newest ``error`` message, if any."""
        return self._c.placements.last_error if self._c is not None else None

    @property
    def last_step(self) -> StepRecord | None:
        """The newest StepRecord of this rank, or None before the first step ends. With
        ``dp_mesh``, a replica leader's records are its replica's (the slowest member's
        times), which arrive up to two windows of 8 steps late (docs/meshes.md)."""
        history = self._conn.history
        return history[-1] if history else None

    @property
    def total_steps(self) -> int | None:
        """How many steps the run takes in all, if known (the backend's ETA needs it)."""
        return self.config.total_steps

    def set_total_steps(self, total_steps: int | None) -> None:
        """Tell the backend how many steps the run will take (None: unknown); any time."""
        check_total_steps(total_steps)
        self.config.total_steps = total_steps
        self._conn.set_total_steps(total_steps)

    @property
    def connected(self) -> bool:
        """True while the transport holds a live websocket (always False offline)."""
        return self._conn.connected

    @property
    def dropped(self) -> int:
        """Metric records the transport could not buffer (0 offline)."""
        return self._conn.dropped

    # --- set-up ----------------------------------------------------------------------

    def attach(self, model: _Attached, *, gradients: str = "auto") -> _Attached:
        """Make gradients the global-batch mean whatever the split; returns ``model``.

        A pipelined hook (``pp_mesh``) whose rank holds several stages
        (``ScheduleInterleaved1F1B``) attaches the list of its stage modules, each wrapped over
        ``dp_mesh`` on its own: ``hook.attach([stage.submod for stage in stages])``.

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
        if gradients not in GRADIENT_MODES:
            raise ValueError(f"gradients must be one of {GRADIENT_MODES}, got {gradients!r}.")
        c = self._init_distributed("hook.attach()")
        c.weighting.attach(model, gradients)
        c.ensure_started()
        return model

    def pipeline_schedule(self, stages: Any, schedule_cls: Any, *, loss_fn: Any,
                          layers: Sequence[str] | Sequence[Sequence[str]] | None = None,
                          **schedule_kwargs: Any) -> PipelineRun:
        """This step's pipeline schedule, built for the micro-batch count in force (``pp_mesh`` hooks).

        Call it inside ``with hook.step():`` every step with the same stage(s) and schedule:
        this rank's ``PipelineStage`` and the schedule class (``ScheduleGPipe`` or
        ``Schedule1F1B``; or the list of this rank's stages, model stages ``rank, rank + PP, ...``,
        with ``ScheduleInterleaved1F1B``, after ``hook.attach([stage.submod for stage in
        stages])``), ``loss_fn`` the per-micro-batch mean loss; other keyword arguments go
        to the schedule. The schedule is built with this pipeline's share of the placement in
        force as ``n_microbatches`` and ``scale_grads=False`` (each micro-batch counts 1/M of
        the step in the data-parallel reduction), and built again at the step where a new
        placement changes the shares: every stage of every pipeline switches at the same batch
        index. The returned run says which of the step's M micro-batches to feed
        (``run.micro_batches``, positions 0..M-1 in one global order, so the global batch is the
        same whatever the split) and trains them with ``run.step(x, target=y)``. A drained
        pipeline (share 0) runs the fewest micro-batches its schedule takes with weight 0.
        Example (PP2 x DP2 on 4 ranks; docs/pipelines.md)::

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
            model = DDP(part, process_group=mesh["dp"].get_group())
            stage = PipelineStage(model, mesh["pp"].get_local_rank(), 2, device, group=mesh["pp"].get_group())
            hook = RebalanceHook(micro_batches=8, dp_mesh=mesh["dp"], pp_mesh=mesh["pp"])
            hook.attach(model)
            for k in range(steps):
                with hook.step():
                    run = hook.pipeline_schedule(stage, Schedule1F1B, loss_fn=mean_loss)
                    x, y = batch(k, run.micro_batches)          # those micro-batches, concatenated
                    run.step(x) if stage.is_first else run.step(target=y)
                    opt.step(); opt.zero_grad()

        ``layers``: this stage's layer module names, in model order (torchtitan's ``layers.4``,
        ...); without it, the entries of the stage module's ``layers`` container
        (``ModuleDict`` or ``ModuleList``) when it has one. The hello reports every stage's,
        for stage-split advice (docs/pipelines.md).

        A count the schedule refuses (``Schedule1F1B``: 0 or at least as many as stages;
        ``ScheduleInterleaved1F1B``: a multiple of ``max(1, count // PP)``) raises ValueError
        naming what it takes; rank 0 rejects such a placement when it is offered. ``layers``
        with several stages per rank: one list per stage given.
        """
        pipeline = self._pipeline
        if pipeline is None:
            raise RuntimeError("hook.pipeline_schedule() needs a pipeline hook: create it with "
                               "RebalanceHook(dp_mesh=mesh['dp'], pp_mesh=mesh['pp'], micro_batches=M).")
        c = self._init_distributed("hook.pipeline_schedule()")
        if c.weighting.mode is None:
            raise RuntimeError("hook.pipeline_schedule() needs hook.attach(stage.submod) first: the hook weights "
                               "each pipeline's gradient by its share.")
        known = pipeline.name is not None
        run = pipeline.schedule_for(stages, schedule_cls, loss_fn, schedule_kwargs,
                                    scale_locally=c.weighting.mode == "local", layers=layers)
        if not known:
            c.connect()  # now the hello can say the pipeline's shape
        return run

    @property
    def gradients(self) -> str | None:
        """The gradient mechanism ``attach`` chose (None before ``attach``)."""
        return self._c.weighting.mode if self._c is not None else None

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
        depth = check_loader_args(self.config, batch_size, loader_kwargs)  # before the process group is needed
        loading = self._init_distributed("hook.batch_sampler()").loading
        sampler = loading.batch_sampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                        sample_cost=sample_cost, sample_length=sample_length)
        return loading.data_loader(dataset, sampler, depth, loader_kwargs)

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
        return self._init_distributed("hook.batch_sampler()").loading.batch_sampler(
            dataset, shuffle=shuffle, seed=seed, drop_last=drop_last, sample_cost=sample_cost,
            sample_length=sample_length)

    # --- the step --------------------------------------------------------------------

    def step(self) -> StepContext:
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
        return self._c.weighting.loss_weight() if self._c is not None else 1.0

    def token_loss_weight(self, n_valid: int | torch.Tensor | None = None) -> float | torch.Tensor:
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
        once per step, best from the labels before the forward (every rank is then ready for
        the all-reduce); the time a rank waits in it for its peers is timed as sync wait, not
        compute, wherever it is called.
        With micro-batch placements, ``hook.micro_batches(source, valid_tokens=fn)`` counts once
        per step and ``token_loss_weight()`` (no argument) returns the step's factor. Example::

            with hook.step():
                weight = hook.token_loss_weight((labels != -100).sum())
                logits = model(input_ids)
                loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                           ignore_index=-100, reduction="sum")
                (loss_sum * weight).backward()
                opt.step(); opt.zero_grad()
        """
        c = self._init_distributed("hook.token_loss_weight()")
        if n_valid is None:  # micro-batch placements: counted by micro_batches(valid_tokens=)
            return c.micro.step_token_weight()
        return c.weighting.token_loss_weight(n_valid)

    def micro_batches(self, source: Iterable[Any], *, valid_tokens: ValidTokens | None = None) -> MicroBatches:
        """This rank's micro-batches for the step being trained (``micro_batches=M`` hooks).

        Call it inside ``with hook.step():`` with the same source every step (a DataLoader
        over an IterableDataset, a ``StatefulDataLoader``, any iterator of fixed-shape
        micro-batches; the hook keeps its iterator). It takes this rank's share of the
        step's M micro-batches from the source, checks they all have the first one's
        shapes, and yields them; gradient synchronisation is off for all but the last
        (DDP, FSDP2), and each micro-batch's gradient counts ``1 / M`` of the step, so a
        per-micro-batch mean loss trains on the mean over the step's samples. A drained
        rank yields one micro-batch with weight 0 (it still joins the collective).
        ``valid_tokens`` (``micro-batch -> count``) counts the valid tokens of this rank's
        micro-batches once per step; ``hook.token_loss_weight()`` then turns each
        micro-batch's summed token loss into its part of the global token mean. Example::

            hook = RebalanceHook(micro_batches=16)
            hook.attach(model)                       # DDP(torch.compile(m)), fully_shard(m), ...
            for step in range(steps):
                with hook.step():
                    for x, y in hook.micro_batches(stream):
                        loss_fn(model(x), y).backward()
                    opt.step(); opt.zero_grad()

        A stream that ends before this rank's share raises ``StreamEnded`` (a RuntimeError)
        before any of the step's micro-batches is used; a micro-batch of another shape
        raises ValueError.
        """
        return self._init_distributed("hook.micro_batches()").micro.micro_batches(source, valid_tokens=valid_tokens)

    # --- placements ------------------------------------------------------------------

    def request_placement(self, shares: list[int], reason: str = "", *, version: int | None = None,
                          length_sq_weight: float | None = None) -> int:
        """Rank 0: ask for a new split of the global batch; returns its version.

        The placement is validated (one non-negative integer per rank, summing to B,
        newer than the one in force), then broadcast at the next exchange and applied by
        every rank at the same batch index. Invalid input raises ValueError with the
        reason (also sent to the backend as a ``reject``); training goes on unchanged.
        This is the same path a backend ``placement`` message takes.

        ``length_sq_weight`` (k, a number in [0, 1e6]) sets the cost model that goes with
        the placement for samples given by length (``sample_length=``): a sample of length
        L then weighs ``L + k*L^2`` in the split. Left out, the newest placement's k (pending
        or in force) is kept. Example: the same shares with a new cost model::

            hook.request_placement(hook.shares, length_sq_weight=5e-4, reason="attention")
        """
        c = self._init_distributed("hook.request_placement()")
        return c.placements.request(shares, reason, version, length_sq_weight)

    # --- checkpoints -----------------------------------------------------------------

    def checkpointing(self) -> AbstractContextManager[None]:
        """Context manager around a checkpoint write between steps: its time is reported
        as the step's ``ckpt_ms`` (a part of the wait before the next step), so the job's
        causes (docs/causes.md) tell checkpoints from data loading. Example::

            if k % 1000 == 0:
                with hook.checkpointing():
                    torch.save({"model": model.state_dict(), "hook": hook.state_dict()}, path)
        """
        return checkpointing(self._phases)

    def state_dict(self) -> dict[str, Any]:
        """Where the run stands, for a checkpoint: plain ints and lists (JSON-safe).

        ``batch_index`` (the next untrained global batch), the placement in force for it
        and its version, a newer placement already agreed or pending (``next_placement``),
        and the epoch position. Save it with the model and optimizer; every rank holds
        the same. Example::

            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "rebalancer": hook.state_dict()}, path)
        """
        return self._init_distributed("hook.state_dict()").checkpoints.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next step trains ``batch_index`` under the
        placement it had (or a newer one the backend holds), and the loader's sampler
        starts there, in the right epoch of the seeded order.

        Call it on every rank (rank 0's copy is used; with micro-batch placements each
        rank's own ``stream`` entry resumes its stream: save every rank's state), after ``attach`` and before the
        loader is first iterated. Raises ValueError for a state of another job shape
        (global batch size) or out-of-range numbers; a different world size keeps the
        batch index and starts from the uniform split.
        """
        self._init_distributed("hook.load_state_dict()").checkpoints.load_state_dict(state)

    # --- the end --------------------------------------------------------------------

    def close(self, *, wait_for_peers: bool = True) -> None:
        """Finish the exchange in flight, flush metrics, stop the threads. Idempotent.

        Every rank must call it after the same number of steps. ``wait_for_peers=False``
        skips waiting on the exchange in flight (shutting down on a signal, when peers
        may be gone). It may come before or after ``dist.destroy_process_group()``; a hook
        never closed is closed at interpreter exit. In a forked child (a DataLoader
        worker) the hook is already inert and this does nothing.
        """
        self._close(wait_for_peers=wait_for_peers, wait_timeout_s=None)

    def __enter__(self) -> RebalanceHook:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- the lifecycle: each component in turn ---------------------------------------

    def _on_message(self, msg: Message) -> None:
        """A backend message, as the transport thread hands it to the placements."""
        self._init_distributed("a backend message").placements.on_message(msg)

    def _hello(self) -> Hello:
        return self._init_distributed("the hello").hello(self._before)

    def _close(self, *, wait_for_peers: bool, wait_timeout_s: float | None) -> None:
        if self._closed:
            return
        self._closed = True
        _lifecycle.forget(self)  # nothing left for the exit handler
        self._phases.uninstall()
        if self._before.gc_schedule is not None:
            self._before.gc_schedule.restore()
        c = self._c
        if c is None:
            return  # never used: no group, no threads
        c.loop.closed = True
        try:
            if wait_for_peers:
                c.channel.close(timeout_s=wait_timeout_s)
            if c.pace is not None:  # the records of the last window(s), combined if peers wait
                pace = c.pace
                recs = pace.flush(c.loop.next_batch, wait_timeout_s) if wait_for_peers else pace.release()
                for r in recs:
                    self._conn.report(r)  # held by the leader only
        finally:
            close_groups(c, self._grads)
            self._conn.close()
            c.weighting.close()

    def _close_at_exit(self) -> None:
        """The atexit path (trainer_hook._lifecycle): close with a bounded wait for peers."""
        self._close(wait_for_peers=True, wait_timeout_s=_EXIT_WAIT_S)

    def _after_fork_in_child(self) -> None:
        """In a forked child: inert, touching nothing the parent still uses (see _lifecycle)."""
        self._closed = True
        self._forked = True
        self._phases.uninstall()
        self._grads._pg = None
        self._grads._opts = None
        c = self._c
        if c is None:
            return
        c.loop.closed = c.loop.forked = True
        c.placements.after_fork_in_child()
        c.channel.after_fork_in_child()
        if c.pace is not None:
            c.pace.after_fork_in_child()
        self._conn.after_fork_in_child()


class _Unwired:
    """The step's target until the process group is there: builds the components first."""

    def __init__(self, hook: RebalanceHook) -> None:
        self._hook = hook

    def begin(self) -> int:
        hook = self._hook
        if hook._closed:
            raise refuse_closed(hook._forked)
        return hook._init_distributed("the first batch").loop.begin()

    def end(self, *, failed: bool) -> None:  # never reached: begin() hands the step over
        pass

    def report_oom(self, exc: BaseException) -> None:
        pass

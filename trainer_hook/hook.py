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

One module, over 400 lines on purpose: the whole public API in one place, each method a
short forward to the private parts beside its full docstring and example.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from rebalancer_wire.protocol import MAX_LENGTH_SQ_WEIGHT, StepRecord
from trainer_hook._checkpoint import Checkpoints
from trainer_hook._hook_base import _COMM_KIND, _StepContext
from trainer_hook._hook_base import HOOK_VERSION as HOOK_VERSION  # re-exported: zero_code reads it
from trainer_hook._loading import LoaderWiring
from trainer_hook._micro_steps import MicroBatchSteps, gradient_sync_switch
from trainer_hook._steps import StepLoop
from trainer_hook.config import check_total_steps
from trainer_hook.gradients import (
    check_data_parallel,
    register_grad_timer,
    register_gradient_weighting,
    register_unshard_timer,
    timing_event,
)
from trainer_hook.placement import PlacementSchedule, ScheduledPlacement

__all__ = ["RebalanceHook"]

log = logging.getLogger("trainer_hook")
_GRADIENT_MODES = ("auto", "comm_hook", "loss_scale")


def check_length_sq_weight(value: object) -> float:
    """A cost model's k (of ``L + k*L^2``) as a float, or ValueError naming the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"length_sq_weight must be a number in [0, {MAX_LENGTH_SQ_WEIGHT:g}] (k of L + k*L^2), "
                         f"got {value!r}.")
    k = float(value)
    if not (math.isfinite(k) and 0.0 <= k <= MAX_LENGTH_SQ_WEIGHT):
        raise ValueError(f"length_sq_weight must be a number in [0, {MAX_LENGTH_SQ_WEIGHT:g}] (k of L + k*L^2), "
                         f"got {k}.")
    return k


class RebalanceHook(StepLoop, LoaderWiring, Checkpoints, MicroBatchSteps):
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
    """

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
        self._model, self._sync_switch = model, gradient_sync_switch(model)
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
        if n_valid is None:  # micro-batch placements: counted by micro_batches(valid_tokens=)
            return self._step_token_weight()
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
                cpu = total.device.type == "cpu"
                # A wait for peers, not compute (invariant 11): a fast rank waits here for
                # the slowest one's forward. On a device, events bracket the compute
                # stream's wait for the collective.
                events = None if cpu else timing_event(total.device.type)
                grads = self._grads
                grads.begin_wait(events)
                try:
                    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._channel.group if cpu else None)
                finally:
                    grads.end_wait(events)
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
            grads = self._grads
            grads.begin_wait(None)  # a wait for peers, not compute (invariant 11)
            try:
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self._channel.group)
            finally:
                grads.end_wait(None)
            count = float(buf[0]) / self._members  # every member of a replica counted the same tokens
        return scale / count if count > 0 else 0.0

    def _token_scale(self) -> float:
        """1 over the gradient scale attach() applies to this rank's loss after backward."""
        mode, w = self._gradients_mode, self._grads.weight
        if w <= 0:  # a dummy batch: its loss must not reach the gradients on any path
            return 0.0
        if mode in ("ddp_comm_hook", "fsdp2_reduce_scatter", "fsdp1_comm_hook"):
            return 1.0 / w
        if mode == "local":  # micro-batch placements scale the accumulated gradients by w
            return 1.0 / w if self.config.micro_batches is not None else 1.0
        return float(self._world_size)  # the wrapper averages over ranks (loss_scale, or no attach)

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
        self._init_distributed("hook.request_placement()")
        if not self._root:
            raise RuntimeError(
                f"request_placement() was called on rank {self._rank}; only rank 0 decides "
                "placements. Call it on rank 0 (the others learn it at the next exchange)."
            )
        if length_sq_weight is not None:
            length_sq_weight = check_length_sq_weight(length_sq_weight)
        with self._lock:
            pending = self._channel.undelivered
            if version is None:
                version = 1 + max(self._schedule.latest.version, pending.version if pending else 0)
            if length_sq_weight is None:
                newest = pending if pending is not None else self._schedule.latest
                length_sq_weight = newest.length_sq_weight
        error = self._offer(version, shares, reason, self.config.global_batch_size, length_sq_weight)
        if error is not None:
            raise ValueError(error)
        return version

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

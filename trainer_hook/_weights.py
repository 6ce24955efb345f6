"""Weighting: how this rank's gradients become its part of the global-batch mean. Owns
the mechanism ``attach`` chose (comm hook, FSDP reduce-scatter, loss scaling), its
handles, the attached model and its batch norms, and the loss factors
(``loss_weight``, ``token_loss_weight``); the per-batch weight itself lives in the
GradientState the step loop sets."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from trainer_hook._connection import Connection
from trainer_hook._ranks import Ranks
from trainer_hook.channel import ControlChannel
from trainer_hook.config import HookConfig
from trainer_hook.gradients import (
    GradientState,
    check_data_parallel,
    register_grad_timer,
    register_gradient_weighting,
    register_unshard_timer,
    timing_event,
)

log = logging.getLogger("trainer_hook")
GRADIENT_MODES = ("auto", "comm_hook", "loss_scale")
# The collective each gradient mechanism reports its bytes for (Hello.comm_kind).
COMM_KIND = {"ddp_comm_hook": "all_reduce", "fsdp2_reduce_scatter": "reduce_scatter",
             "fsdp1_comm_hook": "reduce_scatter"}


class Weighting:
    """``attach``, ``loss_weight`` and ``token_loss_weight`` of a RebalanceHook."""

    def __init__(self, *, config: HookConfig, ranks: Ranks, grads: GradientState, channel: ControlChannel,
                 connection: Connection, dp_mesh: Any, pipelined: bool = False) -> None:
        self._config = config
        self._world_size = ranks.world_size
        self._members = ranks.members
        self._grads = grads
        self._channel = channel
        self._conn = connection
        self._dp_mesh = dp_mesh
        self._pipelined = pipelined  # pp_mesh given: a pipeline stage's module is what attach weights
        self.mode: str | None = None
        self.model: torch.nn.Module | None = None
        self.norms: list[torch.nn.Module] = []  # batch norms kept out of dummy steps
        self._handles: list[Any] = []

    @property
    def weight(self) -> float:
        """This rank's gradient weight for the batch being trained (set by the step loop)."""
        return self._grads.weight

    @property
    def comm_kind(self) -> str:
        return COMM_KIND.get(self.mode or "", "")

    def attach(self, model: Any, gradients: str) -> None:
        if self.mode is not None:
            raise RuntimeError("attach() was already called on this hook; call it once per model "
                               "(an interleaved pipeline rank: once, with the list of its stage modules).")
        if isinstance(model, (list, tuple)):
            self._attach_stages(list(model), gradients)
            return
        grads, world = self._grads, self._world_size
        if gradients == "loss_scale":
            if self._pipelined:
                raise ValueError(
                    "gradients='loss_scale' does not apply to pipelines: the schedule runs the backward. "
                    "Attach with the default gradients='auto' (DDP or FSDP2 over dp_mesh); the hook then "
                    "weights each pipeline's gradient by its share (docs/pipelines.md).")
            check_data_parallel(model, world, dp_mesh=self._dp_mesh)
            self._handles = register_grad_timer(model, grads)
            mode = "loss_scale"
        else:
            mode = register_gradient_weighting(model, grads, world, dp_mesh=self._dp_mesh, pipelined=self._pipelined)
            if mode == "local":
                self._handles = register_grad_timer(model, grads)
        # FSDP's parameter all-gathers are waits for peers on either path.
        self._handles += register_unshard_timer(model, grads)
        self.mode, self.model = mode, model
        if mode in COMM_KIND:
            self._conn.resend_hello()  # the hello sent on connecting could not name the collective yet
        # A drained rank trains a one-sample dummy batch (weight 0); batch norm would fold
        # it into its running statistics (and BatchNorm1d refuses one sample in training).
        # SyncBatchNorm is left alone: in eval it would skip its collective and hang peers.
        self.norms = [
            m for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            and not isinstance(m, torch.nn.SyncBatchNorm)
        ]

    def _attach_stages(self, models: list[Any], gradients: str) -> None:
        """An interleaved pipeline rank's stage modules, each wrapped over ``dp_mesh`` on its
        own: every one weighted with this rank's gradient weight, by one mechanism."""
        if not self._pipelined:
            raise ValueError(
                f"attach() takes one model, got a {type(models).__name__} of {len(models)}: a list of modules "
                "is for an interleaved pipeline rank's stage modules (RebalanceHook(pp_mesh=..., dp_mesh=...)).")
        if not models or not all(isinstance(m, torch.nn.Module) for m in models):
            raise ValueError("attach() takes this rank's stage modules, a non-empty list of torch.nn.Module "
                             f"(each wrapped in DDP or fully_shard over dp_mesh), got {models!r:.120}.")
        if len({id(m) for m in models}) != len(models):
            raise ValueError("attach() was given the same stage module twice: pass each of this rank's stage "
                             "modules once.")
        if gradients == "loss_scale":
            raise ValueError(
                "gradients='loss_scale' does not apply to pipelines: the schedule runs the backward. "
                "Attach with the default gradients='auto' (DDP or FSDP2 over dp_mesh); the hook then "
                "weights each pipeline's gradient by its share (docs/pipelines.md).")
        grads, world = self._grads, self._world_size
        modes = []
        for i, m in enumerate(models):
            modes.append(register_gradient_weighting(m, grads, world, dp_mesh=self._dp_mesh, pipelined=True,
                                                     index=i))
            if modes[-1] == "local":
                self._handles += register_grad_timer(m, grads)
            self._handles += register_unshard_timer(m, grads)
        if len(set(modes)) != 1:
            raise ValueError(f"attach() needs every stage module wrapped alike (all DDP or all fully_shard over "
                             f"dp_mesh), got {', '.join(modes)}.")
        self.mode, self.model = modes[0], models[0]
        if self.mode in COMM_KIND:
            self._conn.resend_hello()
        self.norms = [n for m in models for n in m.modules()
                      if isinstance(n, torch.nn.modules.batchnorm._BatchNorm)
                      and not isinstance(n, torch.nn.SyncBatchNorm)]

    def loss_weight(self) -> float:
        if self.mode == "loss_scale":
            return self._world_size * self._grads.weight
        return 1.0

    def token_loss_weight(self, n_valid: int | torch.Tensor) -> float | torch.Tensor:
        scale = self._token_scale()
        grads = self._grads
        if isinstance(n_valid, torch.Tensor):
            if n_valid.numel() != 1 or n_valid.is_floating_point() and not torch.isfinite(n_valid).all():
                raise ValueError(
                    f"token_loss_weight expects this rank's count of valid tokens (one number), got a "
                    f"tensor of shape {tuple(n_valid.shape)}; pass (labels != ignore_index).sum()."
                )
            total = n_valid.detach().reshape(()).to(torch.float64)
            if grads.weight == 0:  # a dummy batch: its tokens are not the global batch's
                total = torch.zeros_like(total)
            if self._world_size > 1:
                cpu = total.device.type == "cpu"
                # A wait for peers, not compute (invariant 11): a fast rank waits here for
                # the slowest one's forward. On a device, events bracket the compute
                # stream's wait for the collective.
                events = None if cpu else timing_event(total.device.type)
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
        count = float(n_valid) if grads.weight > 0 else 0.0  # a dummy batch counts nothing
        if self._world_size > 1:
            buf = torch.tensor([count], dtype=torch.float64)
            grads.begin_wait(None)  # a wait for peers, not compute (invariant 11)
            try:
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self._channel.group)
            finally:
                grads.end_wait(None)
            count = float(buf[0]) / self._members  # every member of a replica counted the same tokens
        return scale / count if count > 0 else 0.0

    def _token_scale(self) -> float:
        """1 over the gradient scale attach() applies to this rank's loss after backward."""
        mode, w = self.mode, self._grads.weight
        if w <= 0:  # a dummy batch: its loss must not reach the gradients on any path
            return 0.0
        if mode in ("ddp_comm_hook", "fsdp2_reduce_scatter", "fsdp1_comm_hook"):
            return 1.0 / w
        if mode == "local":  # micro-batch placements scale the accumulated gradients by w
            return 1.0 / w if self._config.micro_batches is not None else 1.0
        return float(self._world_size)  # the wrapper averages over ranks (loss_scale, or no attach)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        if not self._grads.release_callbacks():
            log.warning("a gradient all-reduce callback was still held by a communication thread at close()")

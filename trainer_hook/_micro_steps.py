"""MicroSteps: ``hook.micro_batches(source)``, a step's micro-batches under micro-batch
placements. Owns this rank's stream (trainer_hook.microbatch), the step's micro-batches
and token factor, and the model's gradient-sync switch; the step loop tells it where a
step begins and ends, the checkpoint reads and restores its stream."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from trainer_hook._weights import Weighting
from trainer_hook._wrappers import _compiled_inner, _fsdp2_modules, _is_ddp
from trainer_hook.config import HookConfig
from trainer_hook.microbatch import MicroBatches, MicroBatchStream
from trainer_hook.placement import ScheduledPlacement

ValidTokens = Callable[[Any], "int | torch.Tensor"]


def gradient_sync_switch(model: torch.nn.Module | None) -> Callable[[bool], None]:
    """A function that turns the model's gradient synchronisation on or off for the next
    micro-batch: DDP's ``require_backward_grad_sync`` (what ``no_sync()`` sets), FSDP2's
    ``set_requires_gradient_sync``; a plain module has nothing to switch."""
    inner = _compiled_inner(model) if model is not None else None
    if inner is not None and _is_ddp(inner):
        ddp: Any = inner

        def ddp_sync(on: bool) -> None:
            ddp.require_backward_grad_sync = on

        return ddp_sync
    roots = _fsdp2_modules(inner) if inner is not None else []
    if roots:
        return _Fsdp2Sync(roots[0])  # modules() lists the outermost first; its calls recurse
    return _no_switch


def _no_switch(_on: bool) -> None:
    pass


class _Fsdp2Sync:
    """FSDP2 under micro-batch shares: ranks run different numbers of forwards, and each
    forward of a resharded module all-gathers, so within a step parameters stay unsharded
    (reshard after forward and after backward off) until the last micro-batch's backward:
    one all-gather and one reduce-scatter per module and step on every rank, whatever its
    count. Each module's own setting after forward comes back once the step is over."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.saved: list[tuple[Any, Any, Any]] | None = None

    def __call__(self, on: bool) -> None:
        if self.saved is None:  # the step's first micro-batch
            self.saved = _post_forward_settings(self.root)
            self.root.set_reshard_after_forward(False)
        self.root.set_requires_gradient_sync(on)
        self.root.set_reshard_after_backward(on)

    def restore(self) -> None:
        """After the step: each module's reshard-after-forward as it was."""
        saved, self.saved = self.saved, None
        for state, auto, groups in saved or ():
            state._auto_reshard_after_forward = auto
            for group, info in groups:
                group.post_forward_mesh_info = info


def _post_forward_settings(root: Any) -> list[tuple[Any, Any, Any]]:
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in root.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            out.append((state, state._auto_reshard_after_forward,
                        [(g, g.post_forward_mesh_info) for g in state._fsdp_param_groups]))
    return out


class MicroSteps:
    """``micro_batches`` of a RebalanceHook and the step's check that it ran through."""

    def __init__(self, *, config: HookConfig, rank: int, weighting: Weighting) -> None:
        self._config = config
        self._rank = rank
        self._weighting = weighting
        self.stream: MicroBatchStream | None = None
        self.stream_resume: dict[str, Any] | None = None  # a checkpoint's stream state, until the stream exists
        self._switch: Callable[[bool], None] | None = None
        self._mb: MicroBatches | None = None
        self._mb_tokens: Any = None
        self._in_step = False
        self._k = 0
        self._count = 0

    def step_begins(self, k: int, p: ScheduledPlacement) -> None:
        self._in_step, self._mb, self._k, self._count = True, None, k, p.shares[self._rank]

    def step_ends(self) -> None:
        self._in_step = False

    def micro_batches(self, source: Iterable[Any], *, valid_tokens: ValidTokens | None = None) -> MicroBatches:
        """``hook.micro_batches``: this rank's share of the step's micro-batches."""
        if self._config.micro_batches is None:
            raise RuntimeError(
                "hook.micro_batches() needs micro-batch placements: create the hook with "
                "RebalanceHook(micro_batches=M), M the micro-batches of one optimizer step over all ranks.")
        if not self._in_step:
            raise RuntimeError("hook.micro_batches() is called inside `with hook.step():`, once per step.")
        if self._mb is not None:
            raise RuntimeError("hook.micro_batches() was called twice in one step: call it once per step.")
        weighting = self._weighting
        if weighting.mode is None:
            raise RuntimeError(
                "hook.micro_batches() needs hook.attach(model) first: the hook weights each micro-batch "
                "1/M of the step and turns gradient synchronisation off for all but the last.")
        stream = self.stream
        if stream is None:
            stream = self.stream = MicroBatchStream(source, rank=self._rank, resume=self.stream_resume)
            self.stream_resume = None
        elif stream.source is not source:
            raise ValueError(
                "hook.micro_batches() was given another source than in earlier steps: pass the same "
                "iterable every step (the hook keeps its iterator and counts what it consumed).")
        k, count = self._k, self._count
        items = stream.take(count, step=k) if count else [stream.dummy(step=k)]
        self._mb_tokens = None
        if valid_tokens is not None:
            n: Any = 0
            for mb in items:
                n = n + valid_tokens(mb)
            self._mb_tokens = weighting.token_loss_weight(n)
        model = weighting.model
        local = weighting.mode == "local" and model is not None
        switch = self._switch
        if switch is None:
            switch = self._switch = gradient_sync_switch(model)

        def step_over() -> None:  # the last backward ran, or the loop left early
            if isinstance(switch, _Fsdp2Sync):
                switch.restore()
            else:
                switch(True)

        def after_last() -> None:
            step_over()
            w = weighting.weight
            if local and w != 1.0:  # one process: what the comm hook's bucket *= weight does
                with torch.no_grad():
                    for p in model.parameters():  # type: ignore[union-attr]
                        if p.grad is not None:
                            p.grad.mul_(w)

        self._mb = MicroBatches(items, count, switch, after_last, step_over)
        return self._mb

    def step_token_weight(self) -> Any:
        if self._mb is None or self._mb_tokens is None:
            raise ValueError(
                "token_loss_weight() without a count needs hook.micro_batches(source, valid_tokens=fn) "
                "earlier in the same step; otherwise pass this rank's count of valid tokens.")
        return self._mb_tokens

    def check_step(self) -> None:
        """At the end of a step that did not fail: its micro-batches were all trained."""
        mb = self._mb
        if mb is None:
            raise RuntimeError(
                f"step {self._k} ended without hook.micro_batches(source): with micro-batch "
                "placements every step trains its micro-batches through it.")
        if not mb.finished:
            raise RuntimeError(
                f"step {self._k} ended before its {len(mb)} micro-batches were all trained: "
                "iterate hook.micro_batches(...) to its end inside the step (no break).")

"""``hook.micro_batches(source)``: a step's micro-batches under micro-batch placements
(trainer_hook.microbatch holds the stream; this wires it to the step, the gradient
synchronisation and the checkpoint)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from trainer_hook._hook_base import HookBase
from trainer_hook._wrappers import _compiled_inner, _fsdp2_modules, _is_ddp
from trainer_hook.microbatch import MicroBatches, MicroBatchStream

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


class MicroBatchSteps(HookBase):
    """``micro_batches`` of a RebalanceHook and the step's check that it ran through."""

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
        if self.config.micro_batches is None:
            raise RuntimeError(
                "hook.micro_batches() needs micro-batch placements: create the hook with "
                "RebalanceHook(micro_batches=M), M the micro-batches of one optimizer step over all ranks.")
        if not self._in_step:
            raise RuntimeError("hook.micro_batches() is called inside `with hook.step():`, once per step.")
        if self._mb is not None:
            raise RuntimeError("hook.micro_batches() was called twice in one step: call it once per step.")
        if self._gradients_mode is None:
            raise RuntimeError(
                "hook.micro_batches() needs hook.attach(model) first: the hook weights each micro-batch "
                "1/M of the step and turns gradient synchronisation off for all but the last.")
        stream = self._stream
        if stream is None:
            stream = self._stream = MicroBatchStream(source, rank=self._rank, resume=self._stream_resume)
            self._stream_resume = None
        elif stream.source is not source:
            raise ValueError(
                "hook.micro_batches() was given another source than in earlier steps: pass the same "
                "iterable every step (the hook keeps its iterator and counts what it consumed).")
        k = self._next_batch
        count = self._trained.shares[self._rank]
        items = stream.take(count, step=k) if count else [stream.dummy(step=k)]
        self._mb_tokens = None
        if valid_tokens is not None:
            n: Any = 0
            for mb in items:
                n = n + valid_tokens(mb)
            self._mb_tokens = self.token_loss_weight(n)  # type: ignore[attr-defined]
        model = self._model
        local = self._gradients_mode == "local" and model is not None

        switch = self._sync_switch

        def step_over() -> None:  # the last backward ran, or the loop left early
            if isinstance(switch, _Fsdp2Sync):
                switch.restore()
            else:
                switch(True)

        def after_last() -> None:
            step_over()
            w = self._grads.weight
            if local and w != 1.0:  # one process: what the comm hook's bucket *= weight does
                with torch.no_grad():
                    for p in model.parameters():  # type: ignore[union-attr]
                        if p.grad is not None:
                            p.grad.mul_(w)

        self._mb = MicroBatches(items, count, switch, after_last, step_over)
        return self._mb

    def _step_token_weight(self) -> Any:
        if self._mb is None or self._mb_tokens is None:
            raise ValueError(
                "token_loss_weight() without a count needs hook.micro_batches(source, valid_tokens=fn) "
                "earlier in the same step; otherwise pass this rank's count of valid tokens.")
        return self._mb_tokens

    def _check_micro_step(self) -> None:
        mb = self._mb
        if mb is None:
            raise RuntimeError(
                f"step {self._next_batch} ended without hook.micro_batches(source): with micro-batch "
                "placements every step trains its micro-batches through it.")
        if not mb.finished:
            raise RuntimeError(
                f"step {self._next_batch} ended before its {len(mb)} micro-batches were all trained: "
                "iterate hook.micro_batches(...) to its end inside the step (no break).")

"""PyTorch Lightning: ``RebalanceLightningCallback`` and its ``train_dataloader`` helper.

Three things make a ``LightningModule``'s math independent of the split, each in one place:

- data: ``callback.train_dataloader(dataset, ...)`` (call it from the module's or the
  DataModule's ``train_dataloader``) is ``hook.data_loader`` with a ``loader.sampler``
  Lightning takes for its own distributed sampler, so ``Trainer(strategy="ddp")`` keeps
  the rebalancer's per-rank batches (no ``use_distributed_sampler=False`` needed; the
  validation loaders still get Lightning's sampler);
- gradients: ``on_fit_start`` attaches the hook to the DDP model the strategy built
  (``trainer.strategy.model``): each rank's gradients are weighted by its share;
- steps: ``on_train_batch_start`` enters ``hook.step()`` and ``on_train_batch_end`` leaves
  it (around forward, backward and the optimizer step).

Checkpoints: the callback's ``state_dict`` is ``hook.state_dict()``, so Lightning's own
checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``) carry the batch index and
the placement, and ``trainer.fit(..., ckpt_path=...)`` resumes them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data.distributed import DistributedSampler

from trainer_hook.loader import EpochView, HookDataLoader
from trainer_hook.microbatch import refuse_micro_batches
from trainer_hook.sampler import RebalanceBatchSampler

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package name
    import pytorch_lightning as pl  # type: ignore[no-redef]

__all__ = ["RebalanceLightningCallback"]

log = logging.getLogger("trainer_hook")


class _LightningEpochView(EpochView, DistributedSampler):  # type: ignore[type-arg]
    """``loader.sampler`` that Lightning recognises as already distributed: it leaves the
    loader (and the rebalancer's batch sampler in it) as it is."""

    def __init__(self, batch_sampler: RebalanceBatchSampler) -> None:  # no DistributedSampler.__init__
        EpochView.__init__(self, batch_sampler)
        self.shuffle = batch_sampler.shuffle
        self.num_replicas = 1
        self.rank = 0

    def __iter__(self) -> Iterator[int]:
        return EpochView.__iter__(self)

    def __len__(self) -> int:
        return EpochView.__len__(self)

    def set_epoch(self, epoch: int) -> None:
        EpochView.set_epoch(self, epoch)


class _ResumableLoader(HookDataLoader):
    """A HookDataLoader that tells Lightning it resumes by itself: its sampler starts at
    the hook's batch index, which the callback's checkpoint state restores."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def _check_strategy(strategy: Any) -> None:
    """DDP, or FSDP2 through ``ModelParallelStrategy`` over data parallelism only; the rest
    refused naming the fix (``strategy="fsdp"`` is FSDP1, which needs a CUDA device here)."""
    name = type(strategy).__name__
    if name == "DDPStrategy":  # not its subclasses: DeepSpeedStrategy is one
        return
    if name == "ModelParallelStrategy":
        tp = getattr(strategy, "_tensor_parallel_size", 1)
        if tp != 1:
            raise ValueError(
                f"ModelParallelStrategy(tensor_parallel_size={tp}) is not supported with the rebalancer's "
                "Lightning callback: ranks that hold pieces of one model replica must see the same batch. "
                "Use ModelParallelStrategy(data_parallel_size=<world size>, tensor_parallel_size=1) with "
                "fully_shard in configure_model."
            )
        return
    raise ValueError(
        f"The rebalancer's Lightning callback supports strategy='ddp' (DDPStrategy) and FSDP2 through "
        f"ModelParallelStrategy with several processes, got {name}. For FSDP use "
        "Trainer(strategy=ModelParallelStrategy(data_parallel_size=<world size>, tensor_parallel_size=1)) "
        "and fully_shard(...) in the LightningModule's configure_model; the callback weights its "
        "reduce-scatter by each rank's share."
    )


class RebalanceLightningCallback(pl.Callback):
    """Splits each global batch by a RebalanceHook in a Lightning ``Trainer``.

    Example (``torchrun --nproc-per-node 4 train.py`` or Lightning's own launcher)::

        hook = RebalanceHook(job="lit", global_batch_size=256)
        rebalance = RebalanceLightningCallback(hook)

        class Model(LightningModule):
            def train_dataloader(self):
                return rebalance.train_dataloader(train_set, shuffle=True, seed=0, num_workers=4)

        trainer = Trainer(strategy="ddp", callbacks=[rebalance], max_steps=10_000)
        trainer.fit(Model())
        hook.close()

    ``training_step`` returns the mean loss over the batch it is given, as usual, or, for
    a mean over the global batch's valid tokens, its summed token loss times
    ``rebalance.token_loss_weight(n_valid)``. Raises
    for set-ups that cannot be kept exact: gradient accumulation
    (``accumulate_grad_batches`` > 1), a strategy other than DDP, FSDP2 through
    ``ModelParallelStrategy(tensor_parallel_size=1)`` or one process, a DDP
    comm hook of Lightning's own (``DDPStrategy(ddp_comm_hook=...)``), or a training
    loader not made by ``train_dataloader`` here.
    """

    def __init__(self, hook: Any) -> None:
        refuse_micro_batches(hook, "RebalanceLightningCallback")
        self.hook = hook
        self._ctx: Any = None
        self._attached: Any = None
        self._resume: dict[str, Any] | None = None
        self._loader: HookDataLoader | None = None

    # --- data ------------------------------------------------------------------------

    def train_dataloader(
        self, dataset: Sized, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False, **loader_kwargs: Any
    ) -> HookDataLoader:
        """``hook.data_loader(dataset, ...)`` for the module's ``train_dataloader``;
        ``num_workers``, ``collate_fn``, ``pin_memory`` ... pass through."""
        loader = self.hook.data_loader(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last, **loader_kwargs)
        object.__setattr__(loader, "sampler", _LightningEpochView(loader.batch_sampler))
        loader.__class__ = _ResumableLoader  # adds state_dict/load_state_dict only
        self._loader = loader
        return loader  # type: ignore[no-any-return]

    def token_loss_weight(self, n_valid: Any) -> Any:
        """``hook.token_loss_weight(n_valid)``, for a ``training_step`` whose loss is a mean
        over the global batch's valid tokens (the Hugging Face and torchtitan convention)::

            def training_step(self, batch, batch_idx):
                weight = rebalance.token_loss_weight((batch["labels"] != -100).sum())  # before the forward
                logits = self.model(batch["input_ids"])
                loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                           ignore_index=-100, reduction="sum")
                return loss_sum * weight

        Lightning calls ``backward`` on what the step returns; the factor makes the
        parameters follow the global token mean under any split (the DDP comm hook's
        weighting is undone inside it). The value Lightning logs as the loss is this rank's
        part of the global mean, not the mean itself.
        """
        return self.hook.token_loss_weight(n_valid)

    # --- set-up ----------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        accum = getattr(trainer, "accumulate_grad_batches", 1)
        if accum != 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={accum}) is not supported with the rebalancer's "
                "Lightning callback: Lightning accumulates under no_sync, where each micro-batch "
                "would be weighted as a whole batch. Use accumulate_grad_batches=1 and a larger "
                "global_batch_size on the hook."
            )
        strategy = trainer.strategy
        if trainer.world_size > 1:
            _check_strategy(strategy)
        if getattr(strategy, "_ddp_comm_hook", None) is not None:
            raise ValueError(
                "DDPStrategy(ddp_comm_hook=...) is not supported with the rebalancer: the hook "
                "needs DDP's comm hook slot to weight each rank's gradients by its share. Leave "
                "ddp_comm_hook out."
            )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        model = trainer.strategy.model
        if model is None:
            model = pl_module
        if self._attached is None:
            self.hook.attach(model)
            self._attached = model
        elif self._attached is not model:
            raise RuntimeError(
                "The Trainer re-wrapped the model after the rebalancer attached to it; a hook "
                "serves one DDP model. Create a new RebalanceHook and callback to fit again."
            )
        if self._resume is not None:
            state, self._resume = self._resume, None
            self.hook.load_state_dict(state)
        max_steps = int(getattr(trainer, "max_steps", -1) or -1)
        if self.hook.total_steps is None and max_steps > 0:
            self.hook.set_total_steps(max_steps)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._loader is None or trainer.train_dataloader is not self._loader:
            raise ValueError(
                "The training loader was not made by the rebalancer: return "
                "callback.train_dataloader(dataset, ...) from the LightningModule's (or the "
                "DataModule's) train_dataloader, so every rank trains its share of each global batch."
            )

    # --- the step --------------------------------------------------------------------

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        ctx = self.hook.step()
        ctx.__enter__()
        self._ctx = ctx

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:  # the step failed: timed, not counted
            ctx.__exit__(type(exception), exception, exception.__traceback__)

    # --- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``hook.state_dict()``: Lightning saves it in every checkpoint."""
        return self.hook.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Kept until ``on_fit_start``, where the hook is attached and no batch drawn yet;
        strategies that restore after set-up (``ModelParallelStrategy``) call this after
        ``on_fit_start``, still before the first batch: then it loads at once."""
        if self._attached is None:
            self._resume = dict(state_dict)
        else:
            self.hook.load_state_dict(dict(state_dict))

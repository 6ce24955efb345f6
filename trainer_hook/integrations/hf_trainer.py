"""Hugging Face transformers Trainer: ``RebalancingTrainer`` and ``RebalanceCallback``.

Three things make the Trainer's math independent of the split, and each has one place:

- data: ``RebalancingTrainer.get_train_dataloader`` builds the loader on
  ``hook.batch_sampler`` (prepared by Accelerate, not re-sharded);
- gradients: ``RebalanceCallback.on_train_begin`` attaches the hook to the DDP model the
  Trainer created (``trainer.model_wrapped``); where the comm hook cannot be used
  (gradient accumulation), ``compute_loss`` multiplies the loss by ``hook.loss_weight()``;
- steps: the callback enters ``hook.step()`` in ``on_step_begin`` and leaves it in
  ``on_step_end`` (around forward, backward and the optimizer step); with gradient
  accumulation each micro-batch is one hook step, wrapped in ``training_step``.

When the Trainer normalises a token-level loss by the token count of the whole global
batch (``average_tokens_across_devices=True`` with a model taking ``num_items_in_batch``),
its loss is already independent of the split; then no extra weighting is applied.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from trainer_hook.integrations._loader import check_accelerator, prepared_loader, sampler_of
from trainer_hook.microbatch import refuse_micro_batches

__all__ = ["RebalanceCallback", "RebalancingTrainer", "STATE_FILE"]

STATE_FILE = "rebalancer_state.json"  # hook.state_dict() inside each checkpoint-N folder


def hook_steps_for(max_steps: int, accum: int, per_epoch: int) -> int:
    """Hook steps (micro-batches) in ``max_steps`` optimizer steps of ``accum`` micro-batches.

    The Trainer ends each epoch's last accumulation window early when the epoch's
    ``per_epoch`` batches do not divide by ``accum``; 0 for ``per_epoch`` means unknown
    (then every window is taken as full).
    """
    if accum <= 1:
        return max_steps
    if per_epoch <= 0:
        return max_steps * accum
    updates_per_epoch = -(-per_epoch // accum)
    epochs, rest = divmod(max_steps, updates_per_epoch)
    return epochs * per_epoch + min(rest * accum, per_epoch)


class RebalanceCallback(TrainerCallback):
    """Times each optimizer step with ``hook.step()`` and attaches the gradient weighting.

    Added automatically by :class:`RebalancingTrainer`, which also supplies the batch
    sampler. On its own (``Trainer(callbacks=[RebalanceCallback(hook)])``) it refuses
    to start: the Trainer's default loader gives every rank the same batch size, so an
    uneven placement would change the math.
    """

    def __init__(self, hook: Any) -> None:
        refuse_micro_batches(hook, "RebalanceCallback")
        self.hook = hook
        self.trainer: Trainer | None = None
        self.gradients = "comm_hook"
        self.per_micro_batch = False
        self._attached: Any = None
        self._ctx: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        if trainer is None or not isinstance(trainer, RebalancingTrainer):
            raise RuntimeError(
                "RebalanceCallback needs the rebalancer's batch sampler and the DDP model the "
                "Trainer builds: use RebalancingTrainer(rebalance_hook=hook, ...) instead of "
                "Trainer(callbacks=[RebalanceCallback(hook)])."
            )
        model = trainer.model_wrapped
        if self._attached is None:
            self.hook.attach(model, gradients=self.gradients)
            self._attached = model
        elif self._attached is not model:
            raise RuntimeError(
                "The Trainer re-wrapped the model after the rebalancer attached to it; a hook "
                "serves one DDP model. Create a new RebalanceHook and trainer to train again."
            )
        # The job's ETA: the Trainer knows how long the run is. A total the user gave the
        # hook wins.
        max_steps = int(getattr(state, "max_steps", 0) or 0)
        sampler = getattr(trainer, "_rebalance_sampler", None)
        if self.hook.total_steps is None and max_steps > 0:
            per_epoch = len(sampler) if sampler is not None else 0
            accum = int(args.gradient_accumulation_steps) if self.per_micro_batch else 1
            self.hook.set_total_steps(hook_steps_for(max_steps, accum, per_epoch))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.per_micro_batch:
            self._ctx = self.hook.step()
            self._ctx.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:  # a step the Trainer left without on_step_end
            ctx.__exit__(RuntimeError, None, None)


class RebalancingTrainer(Trainer):
    """A transformers ``Trainer`` whose global batch is split by a RebalanceHook.

    ``RebalancingTrainer(rebalance_hook=hook, model=..., args=..., train_dataset=...)``
    takes every other Trainer argument unchanged. The global batch size is the hook's
    ``global_batch_size`` (``per_device_train_batch_size`` is not used for training);
    the order is seeded with ``args.data_seed`` (or ``args.seed``) and shuffled.
    ``sample_cost`` (token counts per dataset index, or a callable) makes the shares
    split work instead of samples (``hook.batch_sampler``), as ``sample_length`` (lengths
    whose cost the backend fits, ``L + k*L^2``) does instead; the Trainer's global token
    mean (``average_tokens_across_devices``) stays exact under that split.
    Example::

        hook = RebalanceHook(job="bert-ft", global_batch_size=64)
        trainer = RebalancingTrainer(
            rebalance_hook=hook, model=model, train_dataset=ds,
            args=TrainingArguments(output_dir="out", max_steps=1000, report_to=[]))
        trainer.train()
        hook.close()

    Raises ValueError for set-ups whose math cannot be kept exact (DeepSpeed, FSDP,
    tensor parallelism, ``split_batches``, ``dispatch_batches``, an iterable dataset).
    """

    def __init__(self, *args: Any, rebalance_hook: Any, sample_cost: Any = None, sample_length: Any = None,
                 **kwargs: Any) -> None:
        if rebalance_hook is None:
            raise ValueError("rebalance_hook is required: RebalancingTrainer(rebalance_hook=RebalanceHook(...), ...).")
        refuse_micro_batches(rebalance_hook, "RebalancingTrainer")
        super().__init__(*args, **kwargs)
        check_accelerator(self.accelerator)
        self.rebalance_hook = rebalance_hook
        self.rebalance_sample_cost = sample_cost  # per dataset index: shares split work (tokens)
        self.rebalance_sample_length = sample_length  # or lengths, whose cost the backend fits
        self.rebalance_callback = RebalanceCallback(rebalance_hook)
        self.rebalance_callback.trainer = self
        accum = int(self.args.gradient_accumulation_steps)
        self.rebalance_callback.per_micro_batch = accum > 1
        # Why: with accumulation a comm hook sees only the sum of several micro-batches,
        # whose weights may differ across a placement change; per-micro-batch loss
        # weights stay exact. A Trainer-normalised token loss needs no weight at all.
        use_loss_scale = accum > 1 or self._loss_is_global()
        self.rebalance_callback.gradients = "loss_scale" if use_loss_scale else "comm_hook"
        self.add_callback(self.rebalance_callback)
        self._rebalance_resumed = False

    def _loss_is_global(self) -> bool:
        """True when the Trainer divides the loss by the global batch's token count."""
        return bool(
            getattr(self.args, "average_tokens_across_devices", False)
            and (getattr(self, "model_accepts_loss_kwargs", False) or getattr(self, "compute_loss_func", None))
        )

    def get_train_dataloader(self) -> Any:
        """The training loader over ``hook.batch_sampler``, prepared but not re-sharded."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset = self.train_dataset
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ValueError(
                f"RebalancingTrainer needs a map-style train_dataset (with __len__ and __getitem__), "
                f"got {type(dataset).__name__}: an iterable dataset has no global order to split."
            )
        collator = self.data_collator
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        args = self.args
        kwargs: dict[str, Any] = {
            "collate_fn": collator,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
        }
        if args.dataloader_num_workers > 0:
            kwargs["persistent_workers"] = args.dataloader_persistent_workers
            if args.dataloader_prefetch_factor is not None:
                kwargs["prefetch_factor"] = args.dataloader_prefetch_factor
        seed = args.data_seed if args.data_seed is not None else args.seed
        loader = prepared_loader(
            self.accelerator, self.rebalance_hook, dataset,
            shuffle=True, seed=seed, drop_last=args.dataloader_drop_last,
            held=max(1, int(args.gradient_accumulation_steps)), sample_cost=self.rebalance_sample_cost,
            sample_length=self.rebalance_sample_length, **kwargs,
        )
        self._rebalance_sampler = sampler_of(loader)
        if self._rebalance_resumed and not args.ignore_data_skip:
            # The Trainer skips the epoch's trained batches itself (skip_first_batches);
            # the sampler, which would start at the hook's batch index, starts the epoch.
            self._rebalance_sampler.start_next_iter_at_epoch_start()
        return loader

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint, plus ``hook.state_dict()`` in ``rebalancer_state.json``."""
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, STATE_FILE), "w") as f:
                json.dump(self.rebalance_hook.state_dict(), f)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The Trainer's resume, plus the hook's batch index and placement (every rank)."""
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = os.path.join(resume_from_checkpoint, STATE_FILE)
        if os.path.isfile(path) and not self._rebalance_resumed:
            with open(path) as f:
                self.rebalance_hook.load_state_dict(json.load(f))
            self._rebalance_resumed = True

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list[Any], Any]:
        """The Trainer's window of micro-batches; on the global token-mean path, a drained
        rank's one-sample dummy batch gets its labels set to -100 before tokens are
        counted, so it adds nothing to the global count nor to the loss."""
        if not self._loss_is_global():
            return super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[no-any-return]
        batches: list[Any] = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        sampler = getattr(self, "_rebalance_sampler", None)
        first = self.rebalance_hook.batch_index  # the window's first batch is trained next
        for i, batch in enumerate(batches):
            labels = batch.get("labels") if isinstance(batch, dict) else None
            if sampler is not None and torch.is_tensor(labels):
                if sampler.local_size(first + i) == 0:
                    batch["labels"] = torch.full_like(labels, -100)
        return batches, self._get_num_items_in_batch(batches, device)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """One micro-batch; with gradient accumulation it is one ``hook.step()`` of its own."""
        ctx = self.rebalance_hook.step() if self.rebalance_callback.per_micro_batch else contextlib.nullcontext()
        with ctx:
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        """The Trainer's loss, weighted by ``hook.loss_weight()`` on the loss-scaling path."""
        result: Any = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if not model.training or self.rebalance_callback.gradients != "loss_scale":
            return result
        loss, outputs = result if return_outputs else (result, None)
        hook = self.rebalance_hook
        if num_items_in_batch is not None and self._loss_is_global():
            # Already a share of the global token mean; a drained rank's dummy sample
            # must still count for nothing.
            if hook.shares[hook.rank] == 0:
                loss = loss * 0.0
        else:
            loss = loss * hook.loss_weight()
        return (loss, outputs) if return_outputs else loss

"""Hugging Face Accelerate: prepare a model, optimizer and DataLoader for rebalancing.

Accelerate wraps the model in DistributedDataParallel and re-shards DataLoaders by
dealing whole batches to processes. ``prepare_with_rebalancer`` keeps the first (and
weights its gradients through the hook) and neutralises the second, so each rank trains
exactly its slice of every global batch under the placement in force.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from trainer_hook.integrations._loader import check_accelerator, prepared_loader
from trainer_hook.microbatch import refuse_micro_batches
from trainer_hook.sampler import SampleCost

__all__ = ["prepare_with_rebalancer", "gradient_mode_for"]


def gradient_mode_for(accelerator: Any) -> str:
    """Which gradient path keeps the math exact under this Accelerator.

    ``"comm_hook"`` (weighted all-reduce) unless gradients are accumulated over several
    micro-batches or Accelerate registers its own DDP comm hook (fp16/bf16 compression,
    PowerSGD); then ``"loss_scale"``: each micro-batch's loss is multiplied by its own
    ``hook.loss_weight()``, which stays exact even if the placement changes inside an
    accumulation window, and leaves DDP's hook slot to Accelerate.
    """
    if int(getattr(accelerator, "gradient_accumulation_steps", 1)) > 1:
        return "loss_scale"
    handler = getattr(accelerator, "ddp_handler", None)
    comm_hook = getattr(handler, "comm_hook", None)
    if comm_hook is not None and str(comm_hook).split(".")[-1].lower() != "no":
        return "loss_scale"
    return "comm_hook"


def prepare_with_rebalancer(
    accelerator: Any,
    hook: Any,
    model: Any,
    optimizer: Any,
    dataset: Sized,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    sample_cost: SampleCost | None = None,
    sample_length: SampleCost | None = None,
    **dataloader_kwargs: Any,
) -> tuple[Any, Any, Any]:
    """``accelerator.prepare`` for rebalanced training; returns ``(model, optimizer, loader)``.

    The model goes through ``accelerator.prepare_model`` (DDP when several processes run)
    and ``hook.attach``; the optimizer through ``accelerator.prepare_optimizer``; the
    loader is a DataLoader over ``hook.batch_sampler(dataset, shuffle, seed, drop_last)``
    prepared for device placement but not re-sharded. ``dataloader_kwargs``
    (``collate_fn``, ``num_workers``, ...) go to ``torch.utils.data.DataLoader``;
    ``batch_size``, ``sampler`` and the like are refused because the hook decides them.
    Prepare schedulers and other objects with ``accelerator.prepare`` as usual.
    ``sample_cost`` (token counts per dataset index, or a callable) makes the shares split
    work instead of samples (``hook.batch_sampler``), as ``sample_length`` (lengths whose
    cost the backend fits, ``L + k*L^2``) does instead; for a mean over valid tokens
    back-propagate ``loss_sum * hook.token_loss_weight(n_valid)`` instead.

    In the loop, wrap each batch in ``hook.step()`` and back-propagate
    ``loss * hook.loss_weight()``: the factor is 1.0 on the comm-hook path and the
    rank's weight on the loss-scaling path (gradient accumulation), so the same loop is
    exact in both::

        accelerator = Accelerator(cpu=True)           # or on GPUs: Accelerator()
        hook = RebalanceHook(job="demo", global_batch_size=64)
        model, optimizer, loader = prepare_with_rebalancer(
            accelerator, hook, model, optimizer, dataset, shuffle=True, seed=0)
        for x, y in loader:
            with hook.step(), accelerator.accumulate(model):
                loss = loss_fn(model(x), y)           # mean over this rank's samples
                accelerator.backward(loss * hook.loss_weight())
                optimizer.step(); optimizer.zero_grad()
        hook.close()

    Raises ValueError for set-ups that cannot be kept exact (DeepSpeed, FSDP,
    Megatron-LM, XLA, tensor/context parallelism, ``split_batches``,
    ``dispatch_batches``) and when the hook's ``lookahead`` is too short for the
    loader's prefetch.
    """
    refuse_micro_batches(hook, "prepare_with_rebalancer")
    check_accelerator(accelerator)
    if int(getattr(accelerator, "num_processes", 1)) != hook.world_size:
        raise ValueError(
            f"Accelerate runs {accelerator.num_processes} process(es) but the hook sees world size "
            f"{hook.world_size}. On a machine without GPUs create Accelerator(cpu=True) (or set "
            "ACCELERATE_USE_CPU=true), otherwise every process trains alone."
        )
    if getattr(model, "_is_accelerate_prepared", False):
        raise ValueError(
            "model was already passed to accelerator.prepare(); pass the bare model to "
            "prepare_with_rebalancer so the hook can attach to the DDP wrapper it creates."
        )
    loader = prepared_loader(
        accelerator, hook, dataset, shuffle=shuffle, seed=seed, drop_last=drop_last, sample_cost=sample_cost,
        sample_length=sample_length, **dataloader_kwargs,
    )
    model = accelerator.prepare_model(model)
    hook.attach(model, gradients=gradient_mode_for(accelerator))
    optimizer = accelerator.prepare_optimizer(optimizer)
    # accelerator.save_state()/load_state() then carry the batch index and placement:
    # a resumed loop continues at the next untrained batch (no skip_first_batches).
    accelerator.register_for_checkpointing(hook)
    return model, optimizer, loader

"""Shared plumbing for the Accelerate-based adapters: a prepared DataLoader that keeps
the hook's per-rank slices exactly as the sampler yields them.

``Accelerator.prepare_data_loader`` wraps any batch sampler in ``BatchSamplerShard``,
which would deal whole batches round-robin to processes (and pad the last ones). Our
sampler is already rank-aware, so the wrapper is turned into a passthrough
(``num_processes=1``), the same move transformers' Trainer makes for its own rank-aware
``BatchRebalanceSampler``. What Accelerate still adds is worth keeping: device placement
and the end-of-dataloader flag its gradient accumulation reads.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["check_accelerator", "prepared_loader", "required_lookahead", "sampler_of"]

# Distributed types whose gradients go through DistributedDataParallel (or no DP at all).
_DDP_TYPES = {
    "NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA",
    "MULTI_SDAA", "MULTI_HPU", "MULTI_NEURON",
}
_OWNED_BY_SAMPLER = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


def check_accelerator(accelerator: Any) -> None:
    """Raise ValueError for Accelerate set-ups whose math the hook cannot keep exact."""
    kind = str(getattr(accelerator, "distributed_type", "NO")).split(".")[-1]
    if kind not in _DDP_TYPES:
        raise ValueError(
            f"Accelerate distributed_type {kind} is not supported by the rebalancer's Accelerate "
            "and Trainer adapters: they weight gradients through the DDP model Accelerate builds "
            "(MULTI_GPU, MULTI_CPU, ...); DeepSpeed, Megatron-LM and XLA reduce gradients their "
            "own way, and the FSDP plugin (Trainer fsdp=...) wraps and reduces outside them. "
            "Launch with plain DDP, or for FSDP write the loop with torchrun: "
            "model = fully_shard(model); hook.attach(model), which the hook keeps exact."
        )
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and (getattr(pc, "tp_enabled", False) or getattr(pc, "cp_enabled", False)):
        raise ValueError(
            "Accelerate parallelism_config with tensor or context parallelism is not supported by "
            "the rebalancer: ranks of one model replica must see the same batch. Use data "
            "parallelism only."
        )
    if getattr(accelerator, "split_batches", False):
        raise ValueError(
            "Accelerator(split_batches=True) is not supported with the rebalancer: the hook's "
            "sampler already gives each rank its own slice of the global batch. Create the "
            "Accelerator with DataLoaderConfiguration(split_batches=False) (the default)."
        )
    if getattr(accelerator, "dispatch_batches", None):
        raise ValueError(
            "Accelerator(dispatch_batches=True) is not supported with the rebalancer: rank 0 "
            "would read and split every batch evenly. Use DataLoaderConfiguration("
            "dispatch_batches=False) and a map-style dataset."
        )


def required_lookahead(num_workers: int, prefetch_factor: int | None, held: int = 1) -> int:
    """Batches the sampler may be asked for ahead of training by a prepared loader.

    Workers prefetch ``num_workers * prefetch_factor`` batches; Accelerate's
    ``DataLoaderShard`` reads one more ahead to see the end of the epoch, and the loop
    holds ``held`` in hand (the Trainer fetches a whole accumulation window at once).
    """
    base = held + 1
    if num_workers <= 0:
        return base
    return num_workers * (prefetch_factor or 2) + base


def prepared_loader(
    accelerator: Any,
    hook: Any,
    dataset: Sized,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    device_placement: bool | None = None,
    held: int = 1,
    sample_cost: Any = None,
    sample_length: Any = None,
    **dataloader_kwargs: Any,
) -> Any:
    """A DataLoader over ``hook.batch_sampler(...)``, prepared by ``accelerator`` without
    re-sharding. ``dataloader_kwargs`` go to ``torch.utils.data.DataLoader``; ``held``
    is how many batches the training loop fetches before it trains the first of them;
    ``sample_cost`` or ``sample_length`` goes to ``hook.batch_sampler`` (shares then split work)."""
    clash = sorted(k for k in _OWNED_BY_SAMPLER if k in dataloader_kwargs)
    if clash:
        raise ValueError(
            f"DataLoader argument(s) {clash} cannot be set here: the rebalancer's batch sampler "
            "decides every rank's batch (its size comes from the hook's global_batch_size and "
            "the placement). Pass shuffle=, seed= and drop_last= to this function instead."
        )
    workers = int(dataloader_kwargs.get("num_workers", 0) or 0)
    need = required_lookahead(workers, dataloader_kwargs.get("prefetch_factor"), held)
    # A measured lookahead (the default) sees all of this at the first step; a given one
    # must cover it.
    if isinstance(hook.config.lookahead, int) and hook.config.lookahead < need:
        raise ValueError(
            f"hook lookahead is {hook.config.lookahead} batches, but this DataLoader may read "
            f"{need} batches ahead (num_workers={workers}, prefetch_factor="
            f"{dataloader_kwargs.get('prefetch_factor') or 2}, {held} held by the loop, plus "
            "Accelerate's one-batch peek). "
            f"Create the hook with RebalanceHook(..., lookahead={need}) or use fewer workers."
        )
    sampler = hook.batch_sampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last, sample_cost=sample_cost,
                                 sample_length=sample_length)
    loader: DataLoader[Any] = DataLoader(dataset, batch_sampler=sampler, **dataloader_kwargs)  # type: ignore[arg-type]
    prepared = accelerator.prepare_data_loader(loader, device_placement=device_placement)
    wrapper: Any = getattr(prepared, "batch_sampler", None)
    if wrapper is sampler:
        return prepared  # one process: Accelerate left the sampler alone
    if getattr(wrapper, "batch_sampler", None) is not sampler or not hasattr(wrapper, "num_processes"):
        raise RuntimeError(
            "Accelerate wrapped the rebalancer's batch sampler in an unexpected way "
            f"({type(wrapper).__name__}); this accelerate version is not supported. Build the "
            "DataLoader with hook.batch_sampler(...) and do not pass it to accelerator.prepare()."
        )
    # Why: our sampler already yields this rank's slice; sharding it again would deal whole
    # slices round-robin to ranks and drop or repeat samples.
    wrapper.num_processes = 1
    wrapper.process_index = 0
    wrapper.batch_size = None  # with a batch size it would hold back batches of other lengths
    return prepared


def sampler_of(loader: Any) -> Any:
    """The hook's batch sampler inside a loader made by ``prepared_loader``."""
    wrapper = getattr(loader, "batch_sampler", None)
    return getattr(wrapper, "batch_sampler", wrapper)

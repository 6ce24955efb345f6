"""Data loader wiring: this rank's batch sampler and the DataLoader over it."""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from torch.utils.data import DataLoader

from trainer_hook._placements import PlacementSwitch
from trainer_hook.sampler import RebalanceBatchSampler, SampleCost


class LoaderWiring(PlacementSwitch):
    """``data_loader`` and ``batch_sampler`` of a RebalanceHook."""

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
        loader = HookDataLoader(dataset, sampler, phases=self._phases, **loader_kwargs)
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
        if self.config.micro_batches is not None:
            raise ValueError(
                "batch_sampler()/data_loader() split samples, but this hook was created with "
                "micro_batches=M (shares count micro-batches): build each rank's own loader of "
                "fixed-shape micro-batches and train them with hook.micro_batches(loader) inside "
                "hook.step() (docs/streaming.md).")
        sampler = RebalanceBatchSampler(
            dataset, schedule=self._schedule, rank=self._rank, shuffle=shuffle, seed=seed,
            drop_last=drop_last, position=lambda: self._next_batch, before_iter=self._ensure_started,
            sample_cost=sample_cost, sample_length=sample_length,
        )
        self._sampler = sampler
        return sampler

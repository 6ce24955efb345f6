"""Loading: this rank's batch sampler and the DataLoader over it. Builds them over the
placement schedule and hands the sampler to the step loop (which reads each batch's size
and cost from it) and the loader's prefetch depth to its lookahead."""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any

from torch.utils.data import DataLoader

from trainer_hook._steps import StepLoop
from trainer_hook.config import HookConfig
from trainer_hook.phases import PhaseClock
from trainer_hook.placement import PlacementSchedule
from trainer_hook.sampler import RebalanceBatchSampler, SampleCost


class Loading:
    """``data_loader`` and ``batch_sampler`` of a RebalanceHook."""

    def __init__(self, *, config: HookConfig, rank: int, schedule: PlacementSchedule, phases: PhaseClock,
                 loop: StepLoop, start: Callable[[], None]) -> None:
        self._config = config
        self._rank = rank
        self._schedule = schedule
        self._phases = phases
        self._loop = loop
        self._start = start  # the placement agreed at start-up, before the sampler's first batch

    def data_loader(self, dataset: Sized, sampler: RebalanceBatchSampler, depth: int,
                    loader_kwargs: dict[str, Any]) -> DataLoader[Any]:
        """``hook.data_loader``: a HookDataLoader over ``sampler`` (from ``batch_sampler``) that
        prefetches ``depth`` batches (``check_loader_args``)."""
        from trainer_hook.loader import HookDataLoader

        loader = HookDataLoader(dataset, sampler, phases=self._phases, **loader_kwargs)
        self._loop.known_lookahead = max(self._loop.known_lookahead, depth + 1)
        return loader

    def batch_sampler(self, dataset: Sized | int, *, shuffle: bool, seed: int, drop_last: bool,
                      sample_cost: SampleCost | None, sample_length: SampleCost | None) -> RebalanceBatchSampler:
        """``hook.batch_sampler``: this rank's sampler, handed to the step loop."""
        if self._config.micro_batches is not None:
            raise ValueError(
                "batch_sampler()/data_loader() split samples, but this hook was created with "
                "micro_batches=M (shares count micro-batches): build each rank's own loader of "
                "fixed-shape micro-batches and train them with hook.micro_batches(loader) inside "
                "hook.step() (docs/streaming.md).")
        sampler = RebalanceBatchSampler(
            dataset, schedule=self._schedule, rank=self._rank, shuffle=shuffle, seed=seed,
            drop_last=drop_last, position=self._position, before_iter=self._start,
            sample_cost=sample_cost, sample_length=sample_length,
        )
        self._loop.sampler = sampler
        return sampler

    def _position(self) -> int:
        return self._loop.next_batch


def check_loader_args(config: HookConfig, batch_size: int | None, loader_kwargs: dict[str, Any]) -> int:
    """The loader's prefetch depth in batches; ValueError for arguments the hook decides."""
    b = config.global_batch_size
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
    if isinstance(config.lookahead, int) and config.lookahead < depth + 1:
        raise ValueError(
            f"lookahead={config.lookahead} is too short for this loader, which prefetches "
            f"{depth} batches: use lookahead={depth + 1} or leave lookahead out (measured)."
        )
    return depth

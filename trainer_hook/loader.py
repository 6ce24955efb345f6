"""HookDataLoader: the DataLoader ``hook.data_loader()`` returns (DDP-tutorial habits work)."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import DataLoader, Sampler

from trainer_hook.phases import PhaseClock, TimedIterator
from trainer_hook.sampler import RebalanceBatchSampler

__all__ = ["HookDataLoader", "EpochView"]


class EpochView(Sampler[int]):
    """``loader.sampler`` of a HookDataLoader: takes ``set_epoch`` like DistributedSampler.

    The loader batches with the hook's batch sampler; this view only answers what scripts
    ask of ``loader.sampler``: ``set_epoch(epoch)``, ``len()`` (the dataset's samples)
    and iteration (the current epoch's global order).
    """

    def __init__(self, batch_sampler: RebalanceBatchSampler) -> None:
        self.batch_sampler = batch_sampler

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return self.batch_sampler.num_samples

    def __iter__(self) -> Iterator[int]:
        s = self.batch_sampler
        position = s._position() if s._position is not None else s._yielded
        return iter(s.global_order(position // len(s)))


class HookDataLoader(DataLoader[Any]):
    """A DataLoader over a RebalanceBatchSampler whose ``sampler`` takes ``set_epoch``."""

    _phases: PhaseClock | None

    def __init__(self, dataset: Sized, batch_sampler: RebalanceBatchSampler, *,
                 phases: PhaseClock | None = None, **kwargs: Any) -> None:
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)  # type: ignore[arg-type]
        # DataLoader refuses to re-set `sampler` after __init__; the view is not used to
        # batch (batch_sampler is), only by scripts calling loader.sampler.set_epoch().
        object.__setattr__(self, "sampler", EpochView(batch_sampler))
        object.__setattr__(self, "_phases", phases)

    def __iter__(self) -> Any:
        it = super().__iter__()
        # The loader's share of the wait before each step (its next()), told apart from
        # the training loop's other host work (docs/causes.md).
        return TimedIterator(it, self._phases) if self._phases is not None else it

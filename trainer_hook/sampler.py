"""RebalanceBatchSampler: each rank's contiguous slice of one seeded global order.

Global batch k is the same set of samples whatever the placement (docs/design.md invariant
1): epoch e's order is a permutation seeded with ``seed + e`` (identity without shuffle),
batch k is the next B samples of it, and rank i takes ``[sum(shares[:i]),
sum(shares[:i+1]))`` of that batch under the placement in force for batch k. The sampler
runs in the main process (DataLoader ``batch_sampler=``), ahead of training when workers
prefetch, which is why it asks the schedule by batch index and nothing else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sized

import torch
from torch.utils.data import IterableDataset

from trainer_hook.placement import PlacementSchedule

__all__ = ["RebalanceBatchSampler"]


class RebalanceBatchSampler:
    """Yields the list of dataset indices this rank trains for each global batch.

    ``position`` returns the batch index training will consume next; each ``iter()``
    starts there, so a loop that breaks out of an epoch and starts another goes on with
    the next untrained batch rather than skipping what the loader had prefetched. Without
    it, the sampler counts the batches it has yielded.

    Batch index k lies in epoch ``k // len(self)``. A rank whose share is 0 (drained)
    gets a one-sample dummy batch (the global batch's first sample) because collate
    functions fail on empty batches; its gradient weight is 0, so it changes nothing.
    ``on_batch`` (if given) is called with ``(batch_index, indices, is_dummy)``.
    """

    def __init__(
        self,
        dataset: Sized | int,
        *,
        schedule: PlacementSchedule,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        position: Callable[[], int] | None = None,
        before_iter: Callable[[], None] | None = None,
        on_batch: Callable[[int, list[int], bool], None] | None = None,
    ) -> None:
        if isinstance(dataset, IterableDataset):
            raise ValueError(
                f"dataset is an IterableDataset ({type(dataset).__name__}): the rebalancer needs a "
                "map-style dataset (__len__ and __getitem__) so that global batch k is the same "
                "samples on every rank and under every split. Wrap the data in a map-style Dataset."
            )
        n = dataset if isinstance(dataset, int) else _length(dataset)
        b = schedule.global_batch_size
        if n <= 0:
            raise ValueError(f"dataset must hold at least one sample, got length {n}.")
        if drop_last and n < b:
            raise ValueError(
                f"dataset has {n} samples, fewer than one global batch of {b} with drop_last=True; "
                "use a smaller global_batch_size or drop_last=False."
            )
        if not 0 <= rank < schedule.world_size:
            raise ValueError(f"rank must be in [0, {schedule.world_size}), got {rank}.")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}.")
        self.num_samples = n
        self.schedule = schedule
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._position = position
        self._before_iter = before_iter
        self._on_batch = on_batch
        self._yielded = 0
        self.furthest = -1  # the highest batch index yielded so far (how far a loader ran ahead)
        self._rewind_once = False
        b = schedule.global_batch_size
        self._per_epoch = n // b if drop_last else -(-n // b)
        self._lock = threading.Lock()
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        """Global batches per epoch (the same on every rank)."""
        return self._per_epoch

    def global_order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order of all dataset indices (the same on every rank)."""
        cached = self._orders.get(epoch)
        if cached is not None:
            return cached
        if self.shuffle:
            gen = torch.Generator()
            gen.manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=gen).tolist()
        else:
            order = list(range(self.num_samples))
        # Keep two epochs: a prefetching loader reads the next epoch while training
        # (and the weight lookups) are still in this one.
        if len(self._orders) >= 2:
            self._orders.pop(min(self._orders))
        self._orders[epoch] = order
        return order

    def global_batch(self, batch_index: int) -> list[int]:
        """All samples of global batch ``batch_index`` in order (every rank's slices)."""
        epoch, j = divmod(batch_index, len(self))
        b = self.schedule.global_batch_size
        return self.global_order(epoch)[j * b : (j + 1) * b]

    def batch_length(self, batch_index: int) -> int:
        """How many samples global batch ``batch_index`` holds (B, or less at epoch end)."""
        j = batch_index % self._per_epoch
        b = self.schedule.global_batch_size
        return min(b, self.num_samples - j * b)

    def local_bounds(self, batch_index: int) -> tuple[int, int]:
        """This rank's slice ``[lo, hi)`` of global batch ``batch_index`` (may be empty).

        A short last batch (``drop_last=False``) is cut in proportion to the shares, so
        every sample of it is still used exactly once.
        """
        placement = self.schedule.at(batch_index)
        n = self.batch_length(batch_index)
        b = self.schedule.global_batch_size
        if n == b:
            return placement.offsets(self.rank)
        return _scaled_offsets(placement.shares, self.rank, n, b)

    def weight(self, batch_index: int) -> float:
        """This rank's gradient weight for ``batch_index``: its real samples over the batch's."""
        lo, hi = self.local_bounds(batch_index)
        return (hi - lo) / self.batch_length(batch_index)

    def local_batch(self, batch_index: int) -> tuple[list[int], bool]:
        """This rank's indices for ``batch_index`` and whether it is a dummy (share 0)."""
        lo, hi = self.local_bounds(batch_index)
        whole = self.global_batch(batch_index)
        if hi > lo:
            return whole[lo:hi], False
        return whole[:1], True

    def __iter__(self) -> Iterator[list[int]]:
        if self._before_iter is not None:
            self._before_iter()
        per_epoch = len(self)
        with self._lock:
            start = self._position() if self._position is not None else self._yielded
            if self._rewind_once:  # a framework skips the epoch's trained batches itself
                self._rewind_once = False
                start -= start % per_epoch
        end = (start // per_epoch + 1) * per_epoch
        for k in range(start, end):
            indices, dummy = self.local_batch(k)
            with self._lock:
                self._yielded = k + 1
                if k > self.furthest:
                    self.furthest = k
            if self._on_batch is not None:
                self._on_batch(k, indices, dummy)
            yield indices

    def start_next_iter_at_epoch_start(self) -> None:
        """The next ``iter()`` starts at the first batch of the current epoch, once: for a
        framework that resumes by skipping the epoch's trained batches itself (the HF
        Trainer's ``skip_first_batches``)."""
        with self._lock:
            self._rewind_once = True

    def set_epoch(self, epoch: int) -> None:
        """Accepted for DistributedSampler compatibility (the DDP tutorial's
        ``sampler.set_epoch(epoch)``). The epoch follows the batch index (batch k is in
        epoch ``k // len(self)``), so a resumed run reshuffles exactly as before and the
        call changes nothing."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch expects an epoch number >= 0, got {epoch!r}.")


def _scaled_offsets(shares: tuple[int, ...], rank: int, n: int, b: int) -> tuple[int, int]:
    # Cumulative boundaries scaled by n/b and floored: monotone, first 0, last n.
    def edge(i: int) -> int:
        return sum(shares[:i]) * n // b

    return edge(rank), edge(rank + 1)


def _length(dataset: Sized) -> int:
    try:
        return len(dataset)
    except TypeError:
        raise ValueError(
            f"dataset must have a length (a map-style dataset) or be an int, got {type(dataset).__name__}; "
            "iterable datasets cannot be split into one global order."
        ) from None

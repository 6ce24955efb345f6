"""RebalanceBatchSampler: each rank's contiguous slice of one seeded global order.

Global batch k is the same set of samples whatever the placement (docs/design.md invariant
1): epoch e's order is a permutation seeded with ``seed + e`` (identity without shuffle),
batch k is the next B samples of it, and rank i takes ``[sum(shares[:i]),
sum(shares[:i+1]))`` of that batch under the placement in force for batch k. The sampler
runs in the main process (DataLoader ``batch_sampler=``), ahead of training when workers
prefetch, which is why it asks the schedule by batch index and nothing else.

With a per-sample cost (``sample_cost=``: token counts, say), a share is a share of the
batch's work, not of its samples: the samples of batch k go to ranks by
longest-processing-time first on ``cost / share`` (ties by position in the batch, then by
rank), a pure function of batch k's samples, their costs and the placement, so every rank
computes the same partition without communication. Batch k is still the same samples,
each trained once, under any placement; a rank's sample count then varies per batch and
its gradient weight is that count over the batch's.

With sample lengths instead (``sample_length=``: token counts of sequences whose cost grows
faster than their length, as attention's does), a sample of length L costs ``L + k*L^2``,
k being the cost model the placement in force carries (``length_sq_weight``: 0, i.e. the
length, until the backend has fitted one from the step times). The step records then
carry the summed lengths and the summed squared lengths the backend fits from.

One module, over 400 lines on purpose: the sampler's one rule (batch k is the same samples
whatever the placement) with its cost partition: both give every rank its part of batch k."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence, Sized
from numbers import Real

import torch
from torch.utils.data import IterableDataset

from trainer_hook.placement import PlacementSchedule

__all__ = ["RebalanceBatchSampler", "SampleCost"]

SampleCost = Sequence[float] | Callable[[int], float]
# (placement, per-rank positions, per-rank work, batch work, per-rank and batch summed
# squared lengths or None without sample lengths)
_Partition = tuple[object, tuple[tuple[int, ...], ...], tuple[float, ...], float,
                   tuple[tuple[float, ...], float] | None]
_PARTITIONS_KEPT = 256  # batch partitions cached: a loader's prefetch plus the step being trained


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

    ``sample_cost`` (optional) gives each dataset index's work: a sequence of numbers >= 0
    (one per index) or a callable ``index -> number``; shares then split work, not samples.
    ``sample_length`` (optional, instead) gives each index's length in the same forms; a
    sample then costs ``L + k*L^2`` with k the placement's ``length_sq_weight``.
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
        sample_cost: SampleCost | None = None,
        sample_length: SampleCost | None = None,
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
        self._cost_fn: Callable[[int], float] | None = None
        self._costs: list[float] | None = None
        if sample_cost is not None and sample_length is not None:
            raise ValueError(
                "pass sample_cost= or sample_length=, not both: sample_cost is each sample's work "
                "as it is, sample_length its length, whose cost the backend fits (L + k*L^2)."
            )
        self.has_lengths = sample_length is not None
        self._cost_name = "sample_length" if self.has_lengths else "sample_cost"
        given = sample_length if sample_length is not None else sample_cost
        if given is not None:
            if callable(given):
                self._cost_fn = given
            else:
                self._costs = _check_cost_sequence(given, n, self._cost_name)
        # batch index -> (placement, per-rank positions in the batch, per-rank work, batch work)
        self._parts: dict[int, _Partition] = {}

    @property
    def has_cost(self) -> bool:
        """Whether samples carry a cost (shares split work) or all cost 1 (shares split samples)."""
        return self._costs is not None or self._cost_fn is not None

    def cost(self, index: int) -> float:
        """Dataset index ``index``'s work (1.0 without ``sample_cost``; its length with
        ``sample_length``)."""
        if self._costs is not None:
            return self._costs[index]
        if self._cost_fn is None:
            return 1.0
        try:
            value = self._cost_fn(index)
        except Exception as exc:
            name = self._cost_name
            raise ValueError(
                f"{name}({index}) raised {type(exc).__name__}: {exc}. The {name} callable must "
                f"return a number >= 0 for every dataset index 0..{self.num_samples - 1}; fix it or pass "
                f"a list of {'lengths' if self.has_lengths else 'costs'}."
            ) from exc
        return _check_cost(value, index, f"{self._cost_name}({index}) returned")

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

    def partition(self, batch_index: int) -> tuple[tuple[int, ...], ...]:
        """Every rank's positions in global batch ``batch_index`` (ascending, disjoint, all
        of them), from the cost partition: ``global_batch(k)[p]`` for ``p`` in entry i are
        rank i's samples. Without a cost, each entry is the rank's contiguous slice."""
        return self._partition(batch_index)[1]

    def _partition(self, batch_index: int) -> _Partition:
        placement = self.schedule.at(batch_index)
        cached = self._parts.get(batch_index)
        if cached is not None and cached[0] is placement:
            return cached
        if not self.has_cost:
            parts = []
            for r in range(self.schedule.world_size):
                lo, hi = self._bounds(batch_index, r)
                parts.append(tuple(range(lo, hi)))
            result: _Partition = (placement, tuple(parts), tuple(float(len(q)) for q in parts),
                                  float(self.batch_length(batch_index)), None)
        elif self.has_lengths:
            lengths = [self.cost(i) for i in self.global_batch(batch_index)]
            k = placement.length_sq_weight
            positions, _ = lpt_partition([v + k * v * v for v in lengths], placement.shares)
            work = tuple(math.fsum(lengths[p] for p in q) for q in positions)
            sq = tuple(math.fsum(lengths[p] ** 2 for p in q) for q in positions)
            result = (placement, positions, work, math.fsum(lengths),
                      (sq, math.fsum(v * v for v in lengths)))
        else:
            costs = [self.cost(i) for i in self.global_batch(batch_index)]
            positions, work = lpt_partition(costs, placement.shares)
            result = (placement, positions, work, float(sum(costs)), None)
        with self._lock:
            if len(self._parts) >= _PARTITIONS_KEPT:
                self._parts.pop(min(self._parts))
            self._parts[batch_index] = result
        return result

    def local_size(self, batch_index: int) -> int:
        """How many samples this rank trains in ``batch_index`` (0: a dummy batch)."""
        if not self.has_cost:
            lo, hi = self.local_bounds(batch_index)
            return hi - lo
        return len(self._partition(batch_index)[1][self.rank])

    def local_work(self, batch_index: int) -> float:
        """This rank's work in ``batch_index`` (its samples' summed cost; its sample count
        without a cost)."""
        if not self.has_cost:
            return float(self.local_size(batch_index))
        return self._partition(batch_index)[2][self.rank]

    def batch_work(self, batch_index: int) -> float:
        """Global batch ``batch_index``'s summed cost (its sample count without a cost)."""
        if not self.has_cost:
            return float(self.batch_length(batch_index))
        return self._partition(batch_index)[3]

    def local_work_sq(self, batch_index: int) -> tuple[float, float] | None:
        """With ``sample_length``: this rank's and the whole batch's summed squared lengths in
        ``batch_index`` (None otherwise)."""
        sq = self._partition(batch_index)[4] if self.has_lengths else None
        return None if sq is None else (sq[0][self.rank], sq[1])

    def local_bounds(self, batch_index: int) -> tuple[int, int]:
        """This rank's slice ``[lo, hi)`` of global batch ``batch_index`` (may be empty).

        A short last batch (``drop_last=False``) is cut in proportion to the shares, so
        every sample of it is still used exactly once. With a cost the rank's samples are
        not one slice: use ``partition`` (``local_size`` for the count).
        """
        if self.has_cost:
            raise RuntimeError(
                "local_bounds() has no answer with sample_cost: a rank's samples are not one slice of "
                "the batch. Use local_size(k) for the count or partition(k) for the positions."
            )
        return self._bounds(batch_index, self.rank)

    def _bounds(self, batch_index: int, rank: int) -> tuple[int, int]:
        placement = self.schedule.at(batch_index)
        n = self.batch_length(batch_index)
        b = self.schedule.global_batch_size
        if n == b:
            return placement.offsets(rank)
        return _scaled_offsets(placement.shares, rank, n, b)

    def weight(self, batch_index: int) -> float:
        """This rank's gradient weight for ``batch_index``: its real samples over the batch's."""
        return self.local_size(batch_index) / self.batch_length(batch_index)

    def local_batch(self, batch_index: int) -> tuple[list[int], bool]:
        """This rank's indices for ``batch_index`` and whether it is a dummy (share 0)."""
        whole = self.global_batch(batch_index)
        if not self.has_cost:
            lo, hi = self.local_bounds(batch_index)
            if hi > lo:
                return whole[lo:hi], False
            return whole[:1], True
        mine = self._partition(batch_index)[1][self.rank]
        if mine:
            return [whole[p] for p in mine], False
        return whole[:1], True

    def samples_fingerprint(self, batch_index: int) -> int:
        """A number that differs, almost surely, between two ranks that would train different
        samples in ``batch_index`` (another seed, shuffle, epoch or placement; the members of
        a mesh replica must agree): a hash of the dummy flag, the count and the first,
        middle and last index of this rank's local batch."""
        if self.has_cost:
            idx, dummy = self.local_batch(batch_index)
            return hash((dummy, len(idx), idx[0], idx[len(idx) // 2], idx[-1]))
        epoch, j = divmod(batch_index, len(self))
        order, at = self.global_order(epoch), j * self.schedule.global_batch_size
        lo, hi = self.local_bounds(batch_index)
        if hi == lo:  # a dummy batch: the global batch's first sample
            return hash((True, 1, order[at]))
        return hash((False, hi - lo, order[at + lo], order[at + (lo + hi) // 2], order[at + hi - 1]))

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


def lpt_partition(costs: Sequence[float], shares: Sequence[int]) -> tuple[tuple[tuple[int, ...], ...], tuple[float, ...]]:
    """Longest-processing-time first: positions of ``costs`` per rank so that ``work_i /
    shares_i`` is as even as LPT makes it; a rank with share 0 gets nothing.

    Deterministic (every rank computes the same answer): samples in decreasing cost, ties
    by position; each goes to the rank whose ``(work + cost) / share`` is least, ties by
    ``(count + 1) / share`` (so zero-cost samples still spread in proportion) then by rank.
    Returns (per-rank ascending positions, per-rank summed cost).
    """
    ranks = [r for r, s in enumerate(shares) if s > 0]
    work = [0.0] * len(shares)
    count = [0] * len(shares)
    mine: list[list[int]] = [[] for _ in shares]
    for p in sorted(range(len(costs)), key=lambda q: (-costs[q], q)):
        c = costs[p]
        best = min(ranks, key=lambda r: ((work[r] + c) / shares[r], (count[r] + 1) / shares[r], r))
        work[best] += c
        count[best] += 1
        mine[best].append(p)
    return tuple(tuple(sorted(m)) for m in mine), tuple(work)


def _check_cost(value: object, index: int, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(
            f"{what} {value!r} for dataset index {index}: a sample's cost must be a number >= 0 "
            "(its token count, say). Fix the cost for that index."
        )
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(
            f"{what} {v} for dataset index {index}: a sample's cost must be a finite number >= 0 "
            "(its token count, say). Fix the cost for that index."
        )
    return v


def _check_cost_sequence(costs: object, n: int, name: str = "sample_cost") -> list[float]:
    what = "length" if name == "sample_length" else "cost"
    if isinstance(costs, (str, bytes)) or not hasattr(costs, "__len__") or not hasattr(costs, "__getitem__"):
        raise ValueError(
            f"{name} must be a sequence of numbers (one per dataset index) or a callable "
            f"index -> number, got {type(costs).__name__}."
        )
    if len(costs) < n:  # type: ignore[arg-type]
        raise ValueError(
            f"{name} holds {len(costs)} {what}s but the dataset has {n} samples: give one "  # type: ignore[arg-type]
            f"{what} per dataset index (or a callable index -> {what})."
        )
    if isinstance(costs, torch.Tensor):
        costs = costs.tolist()
    return [_check_cost(costs[i], i, f"{name} holds") for i in range(n)]  # type: ignore[index]


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

"""PlacementSchedule: which placement (version, shares) is in force for each batch index.

The sampler asks for batch k, possibly several batches ahead of training (DataLoader
prefetch); the gradient hook asks for the batch being trained. Both get the same answer
because a placement is tied to the batch index it starts at, never to the moment it
arrived (docs/design.md invariant 2). ``settled_until`` is the last batch index no future
exchange can change; asking beyond it is an error, not a guess.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

from rebalancer_wire.protocol import check_shares, uniform_shares

__all__ = ["PlacementSchedule", "ScheduledPlacement"]


@dataclass(frozen=True, slots=True)
class ScheduledPlacement:
    """Placement ``version`` with ``shares``, in force from global batch ``start_batch``.

    ``length_sq_weight`` (k) is the cost model that goes with it for samples given by
    length: a sample of length L costs ``L + k*L^2`` in the split (0: its length)."""

    start_batch: int
    version: int
    shares: tuple[int, ...]
    length_sq_weight: float = 0.0

    def offsets(self, rank: int) -> tuple[int, int]:
        """The slice ``[lo, hi)`` of the global batch that ``rank`` trains."""
        lo = sum(self.shares[:rank])
        return lo, lo + self.shares[rank]


class PlacementSchedule:
    """Thread-safe map from batch index to the placement in force (starts at version 0).

    ``settled_until`` may be None (everything settled: a single process with no
    exchanges) or the last batch index whose placement is final.
    """

    def __init__(
        self,
        world_size: int,
        global_batch_size: int,
        *,
        shares: list[int] | None = None,
        version: int = 0,
        settled_until: int | None = None,
    ) -> None:
        self.world_size = world_size
        self.global_batch_size = global_batch_size
        first = (
            uniform_shares(world_size, global_batch_size)
            if shares is None
            else check_shares(shares, world_size=world_size, global_batch_size=global_batch_size)
        )
        self._lock = threading.Lock()
        self._entries = [ScheduledPlacement(0, version, tuple(first))]
        self._starts = [0]
        self._settled_until = settled_until
        # (lo, hi, entry): entry is in force and settled for every batch in [lo, hi). Read
        # without the lock by at() (one tuple load is atomic); replaced under the lock.
        self._hint: tuple[int, int, ScheduledPlacement | None] = (0, 0, None)

    def add(self, start_batch: int, version: int, shares: list[int], *,
            length_sq_weight: float = 0.0) -> ScheduledPlacement:
        """Put ``shares`` in force from ``start_batch`` on. Raises ValueError if invalid.

        The version must be newer than every scheduled one, ``start_batch`` must not be
        earlier than the last scheduled start (placements only move forward) and must lie
        past ``settled_until`` (a settled batch may already sit in a loader's prefetch).
        """
        checked = check_shares(shares, world_size=self.world_size, global_batch_size=self.global_batch_size)
        with self._lock:
            last = self._entries[-1]
            if version <= last.version:
                raise ValueError(f"placement version {version} is not newer than version {last.version} already scheduled.")
            if self._settled_until is not None and start_batch <= self._settled_until:
                raise ValueError(
                    f"placement version {version} would start at batch {start_batch}, but batches up "
                    f"to {self._settled_until} are settled (a loader may already hold them)."
                )
            if start_batch < last.start_batch:
                raise ValueError(
                    f"placement version {version} would start at batch {start_batch}, before version "
                    f"{last.version} at batch {last.start_batch}."
                )
            entry = ScheduledPlacement(start_batch, version, tuple(checked), length_sq_weight)
            self._hint = (0, 0, None)
            if start_batch == last.start_batch:
                self._entries[-1] = entry
            else:
                self._entries.append(entry)
                self._starts.append(start_batch)
            return entry

    def replace_initial(self, version: int, shares: list[int], *, length_sq_weight: float = 0.0) -> None:
        """Start over with one placement in force from batch 0 (resume at start-up)."""
        checked = check_shares(shares, world_size=self.world_size, global_batch_size=self.global_batch_size)
        with self._lock:
            self._entries = [ScheduledPlacement(0, version, tuple(checked), length_sq_weight)]
            self._starts = [0]
            self._hint = (0, 0, None)

    def at(self, batch_index: int) -> ScheduledPlacement:
        """The placement in force for ``batch_index``; RuntimeError past ``settled_until``."""
        lo, hi, entry = self._hint  # fast path: the range asked last, no lock, no search
        if lo <= batch_index < hi:
            return entry  # type: ignore[return-value]
        with self._lock:
            settled = self._settled_until
            if settled is not None and batch_index > settled:
                raise RuntimeError(
                    f"The placement for batch {batch_index} is not settled yet (settled up to batch "
                    f"{settled}): the data loader runs further ahead of training than the hook's "
                    "lookahead allows (measured at the first step, or HookConfig.lookahead). "
                    "Pass RebalanceHook(..., lookahead=N) with N at least num_workers * "
                    "prefetch_factor + 1 plus the batches your loop holds, or lower the prefetch."
                )
            i = bisect.bisect_right(self._starts, batch_index) - 1
            entry = self._entries[i]
            # Valid until the next placement starts or the settled range ends, whichever
            # comes first; add() and replace_initial() drop it, settle() only widens what
            # is settled, so a hint never outlives its answer.
            hi = self._starts[i + 1] if i + 1 < len(self._starts) else batch_index + (1 << 62)
            if settled is not None:
                hi = min(hi, settled + 1)
            if i >= 0 and batch_index >= 0:
                self._hint = (entry.start_batch, hi, entry)
            return entry

    def settle(self, batch_index: int | None) -> None:
        """Declare every batch up to ``batch_index`` final (None: all of them)."""
        with self._lock:
            if batch_index is None or self._settled_until is None:
                self._settled_until = batch_index
            else:
                self._settled_until = max(self._settled_until, batch_index)

    def restart_settled(self, batch_index: int) -> None:
        """Set ``settled_until`` to ``batch_index`` even if lower: only for the hook's start
        (the lookahead is agreed, or a run resumes), before any placement may be added."""
        with self._lock:
            self._settled_until = batch_index
            self._hint = (0, 0, None)

    @property
    def settled_until(self) -> int | None:
        with self._lock:
            return self._settled_until

    @property
    def latest(self) -> ScheduledPlacement:
        """The newest scheduled placement (it may start in the future)."""
        with self._lock:
            return self._entries[-1]

    def timeline(self) -> list[ScheduledPlacement]:
        """Every scheduled placement in order of its start batch."""
        with self._lock:
            return list(self._entries)

"""The one rule naming a hung job's rank from its ranks' stall reports (pure).

Every rank of a synchronous job stops when one does: the others wait for it inside the
gradient collective. So the rank to name is the one whose hook says it is stalled
anywhere but there (before its step, computing, in its optimizer); if every report says
"inside the collective", it is a connected rank that sent none (its process may be stopped,
its watchdog with it) and steps the least far; failing that the collective itself hangs
and the report with the lowest batch index is named.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rebalancer_wire.protocol import Hang

__all__ = ["HungRank", "hung_rank"]


@dataclass(frozen=True, slots=True)
class HungRank:
    rank: int
    batch_index: int | None
    phase: str  # a HANG_PHASES name, or "unknown" for a rank that sent no report
    since: float  # Unix time of the rank's last step end
    stack: str
    reported_by: tuple[int, ...]  # the ranks whose watchdogs reported a stall
    nccl_dump: str | None = None  # on CUDA, its NCCL flight recorder's dump path (docs/causes.md)


def hung_rank(reports: Sequence[tuple[int, Hang]], silent: Sequence[tuple[int, int | None, float]]) -> HungRank | None:
    """``reports``: (rank, its stall report); ``silent``: (rank, newest batch index, last
    step's Unix time) of the connected ranks that sent none. None when nobody reports."""
    if not reports:
        return None
    by = tuple(sorted(r for r, _ in reports))
    outside = [(h.batch_index, h.since, r, h) for r, h in reports if h.phase != "sync_wait"]
    if outside:
        _, _, rank, h = min(outside, key=lambda x: x[:3])
        return HungRank(rank, h.batch_index, h.phase, h.since, h.stack, by, h.nccl_dump)
    if silent:
        rank, batch, t = min(silent, key=lambda s: (s[1] if s[1] is not None else -1, s[2], s[0]))
        return HungRank(rank, batch + 1 if batch is not None else None, "unknown", t, "", by)
    _, _, rank, h = min(((h.batch_index, h.since, r, h) for r, h in reports), key=lambda x: x[:3])
    return HungRank(rank, h.batch_index, h.phase, h.since, h.stack, by, h.nccl_dump)

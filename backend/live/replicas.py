"""A mesh job's replicas as the job view shows them (docs/meshes.md): its rows here are its
data-parallel replicas; each lists its members' global ranks and devices, its time (the slowest
member's, as its leader reported it) and which member that is. The one home of that rule,
for the REST job resource and the dashboard's job header, live or from storage."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from backend.live.state import JobView

__all__ = ["replica_rows", "stored_replica_rows"]


def replica_rows(view: JobView) -> list[dict[str, Any]] | None:
    """One row per replica of a live mesh job, by replica index; None for plain data parallel."""
    if view.mesh is None:
        return None
    return [{"replica": r.rank, "members": list(r.members), "member_devices": list(r.member_devices),
             "connected": r.connected,
             "compute_ms": r.compute_ms, "step_ms": r.step_ms, "slowest_rank": r.slowest_rank}
            for r in view.ranks]


def stored_replica_rows(mesh: Any, ranks: Iterable[tuple[int, Sequence[int] | None]]) -> list[dict[str, Any]] | None:
    """The same from storage (a job this backend has not heard since it started): the members
    each replica's leader said; its members' devices, times and the slowest member are live only."""
    if mesh is None:
        return None
    return [{"replica": rank, "members": list(members or ()), "member_devices": [], "connected": False,
             "compute_ms": None, "step_ms": None, "slowest_rank": None}
            for rank, members in ranks]

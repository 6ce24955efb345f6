"""The one rule for a job's status, and the one builder of its inputs; the controller, the
jobs routes, the dashboard feed and /metrics all ask it.

``verdict`` is the controller's own reading (from the policy's last decision or the last
action); what a reader sees also depends on whether ranks are connected, how old the
newest metrics are and whether a proposal waits. ``status_of`` gathers those from a job's
live view and the controller's reading (none for a job it does not know yet), so REST and
the dashboard cannot build them differently. Nothing else computes a status.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:
    from backend.live.hangs import HungRank
    from backend.live.state import JobView

__all__ = ["STATUSES", "Status", "job_status", "status_of", "Reading", "NEVER_CONNECTED", "FIRST_STEPS", "ENDED"]

Status = Literal["warming_up", "balanced", "imbalanced", "proposal_pending", "idle", "degraded", "hung",
                 "ended"]
STATUSES: tuple[Status, ...] = ("warming_up", "balanced", "imbalanced", "proposal_pending", "idle", "degraded",
                                "hung", "ended")
NEVER_CONNECTED = ("idle", "no rank has connected since the backend started")
FIRST_STEPS = ("warming_up", "waiting for the first steps")
ENDED = ("ended", "the run ended: every rank said goodbye")


class Reading(NamedTuple):
    """The controller's reading of a job it knows: its verdict and detail, the pending
    proposal it published, the wall time of the newest metrics or hello, the world size,
    and the job's mode (in ``observe`` a proposal is shown, never waits for anyone)."""

    verdict: str
    detail: str
    pending: Mapping[str, Any] | None
    last_metrics: float | None
    world_size: int
    mode: str = "approve"


def status_of(view: JobView | None, reading: Reading | None, *, now: float,
              stale_after_s: float) -> tuple[str, str]:
    """(status, detail) of a job from its live view (None: not live since start) and the
    controller's reading; without one (the controller does not know the job yet) the job
    warms up and its metrics are as old as live state last saw it."""
    if reading is None:
        last = view.last_seen if view is not None else None
        reading = Reading(*FIRST_STEPS, None, last, view.world_size if view is not None else 0)
    return job_status(
        verdict=reading.verdict, detail=reading.detail, pending=reading.pending,
        connected_ranks=view.connected_ranks if view is not None else None,
        metrics_age_s=None if reading.last_metrics is None else max(now - reading.last_metrics, 0.0),
        stale_after_s=stale_after_s, lost_ranks=view.lost_ranks if view is not None else (),
        world_size=reading.world_size, ended=view is not None and view.ended, mode=reading.mode,
        hung=_hung_text(view.hung, now) if view is not None else None)


def _hung_text(hung: HungRank | None, now: float) -> str | None:
    if hung is None:
        return None
    at = f" at batch {hung.batch_index}" if hung.batch_index is not None else ""
    return (f"rank {hung.rank} stopped stepping{at} ({hung.phase}) {max(now - hung.since, 0.0):.0f} s ago; "
            f"{len(hung.reported_by)} rank(s) report a stall")


def job_status(*, verdict: str, detail: str, pending: Mapping[str, Any] | None,
               connected_ranks: int | None, metrics_age_s: float | None,
               stale_after_s: float, lost_ranks: Sequence[int] = (),
               world_size: int | None = None, ended: bool = False,
               mode: str = "approve", hung: str | None = None) -> tuple[str, str]:
    """(status, one-sentence detail) of a job.

    ``connected_ranks``: ranks with an open hook socket (None: not live since start);
    ``metrics_age_s``: seconds since its newest metrics (None: none yet); ``lost_ranks``:
    ranks whose socket dropped without a close and that have not come back (``degraded``,
    whatever else holds: a dead rank stalls the whole job); ``ended``: every rank said
    goodbye (the run finished: ``ended``, never stale nor pending). In ``observe`` mode a
    proposal is shown but waits for nobody: the verdict stands, the detail names it.
    ``hung``: the sentence naming the rank a stalled job waits on (``hung``: its ranks are
    connected but stopped stepping).
    """
    if connected_ranks is None:
        return NEVER_CONNECTED
    if ended:
        return ENDED
    if lost_ranks:
        shown = ", ".join(map(str, lost_ranks[:8])) + (" ..." if len(lost_ranks) > 8 else "")
        of = f" of {world_size}" if world_size is not None else ""
        return "degraded", f"lost ranks: {shown} ({connected_ranks}{of} connected)"
    if connected_ranks == 0:
        return "idle", "no rank is connected"
    if hung is not None:
        return "hung", hung
    if metrics_age_s is not None and metrics_age_s > stale_after_s:
        return "idle", "no metrics from the job recently"
    if pending is not None and mode != "observe":
        return "proposal_pending", f"proposal {pending['id']} is {pending['status']}: {pending['reason']}"
    if verdict not in STATUSES:
        raise ValueError(f"Unknown job status verdict {verdict!r}; expected one of {', '.join(STATUSES)}.")
    if pending is not None:  # observe mode
        verdict = "imbalanced" if verdict == "proposal_pending" else verdict
        return verdict, (f"observe mode: proposal {pending['id']} is shown, never sent "
                         f"({pending['reason']})")
    return verdict, detail

"""The one rule for a job's status; the controller, the jobs routes, the dashboard feed and
/metrics all ask it.

``verdict`` is the controller's own reading (from the policy's last decision or the last
action); what a reader sees also depends on whether ranks are connected, how old the
newest metrics are and whether a proposal waits. Nothing else computes a status.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["STATUSES", "Status", "job_status", "NEVER_CONNECTED"]

Status = Literal["warming_up", "balanced", "imbalanced", "proposal_pending", "idle"]
STATUSES: tuple[Status, ...] = ("warming_up", "balanced", "imbalanced", "proposal_pending", "idle")
NEVER_CONNECTED = ("idle", "no rank has connected since the backend started")


def job_status(*, verdict: str, detail: str, pending: Mapping[str, Any] | None,
               connected_ranks: int | None, metrics_age_s: float | None,
               stale_after_s: float) -> tuple[str, str]:
    """(status, one-sentence detail) of a job.

    ``connected_ranks``: ranks with an open hook socket (None: not live since start);
    ``metrics_age_s``: seconds since its newest metrics (None: none yet).
    """
    if connected_ranks is None:
        return NEVER_CONNECTED
    if connected_ranks == 0:
        return "idle", "no rank is connected"
    if metrics_age_s is not None and metrics_age_s > stale_after_s:
        return "idle", "no metrics from the job recently"
    if pending is not None:
        return "proposal_pending", f"proposal {pending['id']} is {pending['status']}: {pending['reason']}"
    if verdict not in STATUSES:
        raise ValueError(f"Unknown job status verdict {verdict!r}; expected one of {', '.join(STATUSES)}.")
    return verdict, detail

"""The controller's read side (``ReadModel``): each job's published snapshot with the status
rule applied, counts from memory, and history read through the SQL gateway (routes,
dashboard hub, ``/metrics``, reports). It writes nothing."""

from __future__ import annotations

import logging
from typing import Any

from backend.control import inputs
from backend.control.core import JobStore
from backend.control.errors import (
    InvalidError,
    NotFoundError,
)
from backend.control.status import Reading, status_of
from backend.storage import control as db

__all__ = ["ReadModel"]

log = logging.getLogger("backend.control.controller")


class ReadModel:
    """Answers questions about jobs from the store's snapshots (and SQL for history)."""

    def __init__(self, *, store: JobStore):
        self.store = store

    def job_control(self, job: str) -> dict[str, Any]:
        """Control state of a job for the job resource, the dashboard and /metrics ({} if
        unknown): the snapshot the last change published, with the status rule applied."""
        st = self.store.get(job)
        if st is None:
            return {}
        status, detail = self.job_status(job)
        return {**st.snapshot, "status": status, "status_detail": detail}

    def job_status(self, job: str) -> tuple[str, str]:
        """(status, detail) of any job, known to the controller or not (``status_of``)."""
        st = self.store.get(job)
        reading = None if st is None else Reading(
            st.status, st.status_detail, st.snapshot["pending_proposal"], st.last_metrics, st.world_size,
            st.mode)
        return status_of(self.store.live.view(job), reading, now=self.store.wall(),
                         stale_after_s=self.store.settings.stale_after_s)

    def cost_fit(self, job: str) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """Per-rank (a_ms, c_ms) from the policy's last decision that fitted the job (the
        one per-rank cost fit; the dashboard's uniform-split estimate uses it)."""
        st = self.store.get(job)
        return st.cost_fit if st is not None else None

    def proposal_counts(self, job: str) -> dict[str, int]:
        """Proposals of ``job`` by status, for Prometheus ({} if unknown)."""
        st = self.store.get(job)
        return dict(st.counts) if st is not None else {}

    def activity_counts(self, job: str) -> dict[str, dict[str, int]]:
        """Proposals and placements of ``job`` by source, and placements a hook rejected,
        counted from the stored rows after every change: Prometheus counters that survive a
        restart ({} if unknown)."""
        st = self.store.get(job)
        return {k: dict(v) for k, v in st.activity.items()} if st is not None else {}

    async def policy_settings(self, job: str) -> dict[str, Any]:
        """Effective policy settings of a job (stored values over the backend defaults)."""
        st = await self.store.require(job)
        return inputs.policy_settings(st.policy, st.mode, self.store.settings)

    async def overrides(self, job: str) -> dict[str, Any]:
        """The overrides in force for ``job``."""
        return dict((await self.store.require(job)).overrides)

    async def placements(self, job: str, limit: int = 100) -> list[dict[str, Any]]:
        await self.store.require(job)
        return await self.store.sql(lambda s: [r.public() for r in db.list_placements(s, job, limit=limit)])

    async def proposals(self, job: str, status: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        await self.store.require(job)
        if status is not None and status not in db.PROPOSAL_STATUSES:
            raise InvalidError(f"status must be one of {', '.join(db.PROPOSAL_STATUSES)}; got {status!r}.")
        return await self.store.sql(lambda s: [r.public() for r in db.list_proposals(s, job, status=status, limit=limit)])

    async def proposal(self, job: str, proposal_id: int) -> dict[str, Any]:
        await self.store.require(job)
        row = await self.store.sql(lambda s: (p.public() if (p := db.get_proposal(s, job, proposal_id)) else None))
        if row is None:
            raise NotFoundError(f"Proposal {proposal_id} not found for job '{job}'.")
        return row

    async def audit(self, job: str, limit: int = 200) -> list[dict[str, Any]]:
        await self.store.require(job)
        return await self.store.sql(lambda s: [r.public() for r in db.list_audit(s, job, limit=limit)])

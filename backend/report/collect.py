"""``RunReports``: owner of the end-of-run reports. It gathers a report's inputs (stored
windows and ranks, the controller's placements and proposals, the dashboard feed's savings,
prices from settings), builds it (``backend.report.build``) and stores it.

A job's report is stored when every rank said goodbye (``job_ended``, from ingest) or when
an operator asks (``POST /api/v1/jobs/{job}/report``). ``GET`` serves the stored one, or
builds one on the spot for a job still running. SQL runs on worker threads only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import sessionmaker

from backend.dashboard.hub import DashboardHub
from backend.live.forecast import hourly_cost
from backend.live.state import LiveState
from backend.report.build import RankInfo, ReportInputs, build_report
from backend.settings import Settings
from backend.storage import metrics as store
from backend.storage import reports as db

__all__ = ["RunReports", "GOODBYE", "ON_DEMAND"]

log = logging.getLogger("rebalancer.report")
GOODBYE = "every rank said goodbye"
ON_DEMAND = "on demand"


class RunReports:
    def __init__(self, *, sessionmaker: sessionmaker, live: LiveState, controller: Any,
                 hub: DashboardHub, settings: Settings, flush: Callable[[], int],
                 clock: Callable[[], float] = time.time):
        self._sf = sessionmaker
        self._live = live
        self._controller = controller
        self._hub = hub
        self._settings = settings
        self._flush = flush
        self._clock = clock
        self._tasks: set[asyncio.Task[Any]] = set()
        self.stored_count = 0

    # --- reads ----------------------------------------------------------------------------

    def stored(self, job: str) -> dict[str, Any] | None:
        with self._sf() as s:
            return db.get_report(s, job)

    def build(self, job: str, *, reason: str = ON_DEMAND, finished: bool = False) -> dict[str, Any] | None:
        """The report of ``job`` from what is stored now (None if the job is unknown)."""
        with self._sf() as s:
            row = store.get_job(s, job)
            if row is None:
                return None
            rank_rows = store.list_ranks(s, job)
            totals = db.rank_totals(s, job)
            series = db.step_series(s, job)
            window = self._settings.policy_window_steps
            fit = {r.rank: db.fit_windows(s, job, r.rank, window) for r in rank_rows}
        price = self._settings.price_for
        ranks = [RankInfo(r.rank, r.host, r.device_type, r.device_name, price(r.device_type, r.device_name))
                 for r in rank_rows]
        cost_h, unpriced = hourly_cost(price, ((r.device_type, r.device_name) for r in rank_rows))
        placements: list[dict[str, Any]] = []
        proposals: list[dict[str, Any]] = []
        if self._controller.known(job):
            placements = self._controller.placements(job, limit=100_000)
            proposals = self._controller.proposals(job, limit=100_000)
        return build_report(ReportInputs(
            job=job, world_size=row.world_size, global_batch_size=row.global_batch_size,
            finished=finished, reason=reason, generated_at=self._clock(), ranks=ranks, totals=totals,
            series=series, fit_windows=fit, placements=placements, proposals=proposals,
            savings=self._hub.savings(job), cost_per_hour=cost_h, unpriced_ranks=unpriced,
            fit_window_steps=window,
        ))

    # --- writes ---------------------------------------------------------------------------

    def store(self, job: str, *, reason: str, finished: bool) -> dict[str, Any] | None:
        """Persist what live state still holds, build the report and store it (blocking)."""
        self._flush()
        report = self.build(job, reason=reason, finished=finished)
        if report is None:
            return None
        with self._sf() as s:
            db.save_report(s, job, report, reason, report["generated_at"])
            s.commit()
        self.stored_count += 1
        log.info("stored the run report of job %s (%s)", job, reason)
        return report

    def job_ended(self, job: str) -> None:
        """Every rank of ``job`` said goodbye: store its report in the background."""
        task = asyncio.get_running_loop().create_task(self._store_ended(job), name=f"report-{job}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _store_ended(self, job: str) -> None:
        # The last metrics frames were handled before the goodbye; give the hub a tick to
        # close the last batches, so that the savings include them.
        await asyncio.sleep(2 * self._hub.interval_s)
        try:
            await asyncio.to_thread(self.store, job, reason=GOODBYE, finished=True)
        except Exception:  # the database may be away; an operator can still ask for it
            log.exception("storing the run report of job %s failed", job)

    async def stop(self) -> None:
        for task in list(self._tasks):
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=10)
            except Exception:
                log.exception("a run report was still being stored at shutdown")

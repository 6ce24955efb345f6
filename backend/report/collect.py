"""``RunReports``: owner of the end-of-run reports. It gathers a report's inputs (stored
windows and ranks through the SQL gateway, the controller's placements and proposals, the
run's summary for the savings, prices from settings), builds it (``backend.report.build``,
on a worker thread: the policy's fits are CPU work) and stores it into the run's summary.

``JobLifecycle.store_report`` (``backend.loops``) persists what live state still holds first;
it runs when every rank said goodbye (``JobLifecycle.run_ended``, from ingest) or when an operator asks
(``POST /api/v1/jobs/{job}/report``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from backend.control.errors import NotFoundError
from backend.live.causes import job_causes
from backend.live.forecast import goodput, hourly_cost
from backend.live.pipeline import pipeline_view
from backend.policy.causes import CauseReport
from backend.report.build import RankInfo, ReportInputs, build_report
from backend.storage import metrics as store
from backend.storage import reports as db
from backend.storage.summaries import get_summary

if TYPE_CHECKING:
    from backend.control.controller import Controller
    from backend.dashboard.hub import DashboardHub
    from backend.live.state import LiveState
    from backend.settings import Settings
    from backend.storage.gateway import SqlGateway

__all__ = ["RunReports", "GOODBYE", "ON_DEMAND"]

log = logging.getLogger("rebalancer.report")
GOODBYE = "every rank said goodbye"
ON_DEMAND = "on demand"
_SAVINGS = ("measured_s", "uniform_s", "saved_s", "saved_cost")


@dataclass
class _Stored:
    world_size: int
    global_batch_size: int
    ranks: list[Any]
    totals: list[db.RankTotals]
    series: list[dict[str, Any]]
    fits: dict[int, list[tuple[int, float, float]]]
    summary: dict[str, Any] | None


class RunReports:
    def __init__(self, *, sql: SqlGateway, controller: Controller, hub: DashboardHub,
                 settings: Settings, live: LiveState, clock: Callable[[], float] = time.time):
        self._sql = sql
        self._live = live
        self._controller = controller
        self._hub = hub
        self._settings = settings
        self._clock = clock
        self.stored_count = 0

    async def stored(self, job: str) -> dict[str, Any] | None:
        return await self._sql.run(lambda s: db.get_report(s, job))

    def _read(self, s: Session, job: str) -> _Stored | None:
        row = store.get_job(s, job)
        if row is None:
            return None
        ranks = store.list_ranks(s, job)
        window = self._settings.policy_window_steps
        return _Stored(row.world_size, row.global_batch_size, ranks, db.rank_totals(s, job),
                       db.step_series(s, job), {r.rank: db.fit_windows(s, job, r.rank, window) for r in ranks},
                       get_summary(s, job))

    async def build(self, job: str, *, reason: str = ON_DEMAND, finished: bool = False) -> dict[str, Any] | None:
        """The report of ``job`` from what is stored now (None if the job is unknown)."""
        got = await self._sql.run(lambda s: self._read(s, job))
        if got is None:
            return None
        try:
            placements = await self._controller.placements(job, limit=100_000)
            proposals = await self._controller.proposals(job, limit=100_000)
        except NotFoundError:  # seen, but never under control (no hello handled since)
            placements, proposals = [], []
        # Savings: the run's summary (live from the dashboard feed, else the stored one).
        summary = self._hub.run_summary(job) or got.summary
        savings = {k: summary.get(k) for k in _SAVINGS} if summary else None
        price = self._settings.price_for
        ranks = [RankInfo(r.rank, r.host, r.device_type, r.device_name, price(r.device_type, r.device_name))
                 for r in got.ranks]
        cost_h, unpriced = hourly_cost(price, ((r.device_type, r.device_name) for r in got.ranks))
        inputs = ReportInputs(
            job=job, world_size=got.world_size, global_batch_size=got.global_batch_size,
            finished=finished, reason=reason, generated_at=self._clock(), ranks=ranks, totals=got.totals,
            series=got.series, fit_windows=got.fits, placements=placements, proposals=proposals,
            savings=savings, cost_per_hour=cost_h, unpriced_ranks=unpriced,
            fit_window_steps=self._settings.policy_window_steps,
            communication=_communication(self._live.communication(job)),
            causes=_causes(job_causes(self._live, job)),
            goodput=goodput(view) if (view := self._live.view(job)) is not None else None,
            pipeline=pipeline_view(self._live.pipelines, job,
                                   self._controller.job_control(job).get("pipeline_prediction")))
        return await asyncio.to_thread(build_report, inputs)

    async def store(self, job: str, *, reason: str, finished: bool) -> dict[str, Any] | None:
        """Build the report and store it in the run's summary (None if the job is unknown)."""
        report = await self.build(job, reason=reason, finished=finished)
        if report is None:
            return None

        def save(s: Session) -> None:
            db.save_report(s, job, report, reason, report["generated_at"])
            s.commit()

        await self._sql.run(save)
        self.stored_count += 1
        log.info("stored the run report of job %s (%s)", job, reason)
        return report


def _communication(comm: Any) -> dict[str, Any] | None:
    """The run's last communication figures (``backend.policy.comm``; live state only: they
    are not stored), None when live state no longer holds the job or saw no step."""
    if comm is None or comm.n_steps == 0:
        return None
    return {**comm.figures(), "ranks": [
        {"rank": r.rank, "comm_bytes_per_step": r.comm_bytes_per_step, "comm_ms": r.comm_ms,
         "wait_ms": r.wait_ms, "busbw_gbps": r.busbw_gbps} for r in comm.ranks]}


def _causes(report: CauseReport | None) -> list[dict[str, Any]] | None:
    """The run's causes of lost time over its last steps (live state only), largest first."""
    if report is None or report.steps == 0:
        return None
    return [{"cause": c.cause, "ranks": list(c.ranks), "ms_per_step": round(c.ms_per_step, 3),
             "share_of_step": round(c.share_of_step, 4), "gpu_hours_lost": round(c.gpu_hours_lost, 6),
             "predicted_step_ms_without": round(c.predicted_step_ms_without, 3), "remedy": c.remedy}
            for c in report.causes]

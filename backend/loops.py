"""What one backend app runs in the background, one object a job, each holding its own state:
``Persistence`` (metric windows and dashboard series to SQL), ``Retention`` (old history
deleted), ``Revocations`` (sockets of revoked tokens closed), ``JobLifecycle`` (run reports,
idle jobs leaving memory), ``HandOver`` (a job another replica took), ``Every`` (one loop);
``Background`` starts and stops them in order. ``backend.parts`` builds them all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from backend.auth.sockets import TokenSockets
from backend.auth.tokens import AuthService
from backend.control.controller import Controller
from backend.dashboard.hub import DashboardHub
from backend.live.state import LiveState
from backend.live.windows import Pending, aggregate_windows
from backend.peers.connections import HookConnections
from backend.report.collect import GOODBYE, RunReports
from backend.settings import Settings
from backend.storage import list_jobs
from backend.storage.gateway import SqlGateway
from backend.storage.health import StorageHealth, report_fault
from backend.storage.summaries import (
    delete_older_than,
    get_summary,
    insert_points,
    recent_points,
    save_summary,
)
from backend.storage.writes import WriteBuffer, database_fault
from backend.tasks import cancel_and_wait
from rebalancer_wire.protocol import CLOSE_TRY_AGAIN_LATER

if TYPE_CHECKING:
    from backend.cluster import Forwarder, JobLeases, LiveFanout

__all__ = ["Background", "Every", "HandOver", "JobLifecycle", "Persistence", "Retention", "Revocations"]

log = logging.getLogger("rebalancer")


class Every:
    """One background loop: ``step()`` every ``period_s`` seconds (after the first period, or
    at once with ``first_now``). ``step`` handles its own errors; one it lets out ends the loop."""

    def __init__(self, name: str, period_s: float, step: Callable[[], Awaitable[Any]], *,
                 first_now: bool = False):
        self.name = name
        self.period_s = period_s
        self._step = step
        self._first_now = first_now
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        if self._first_now:
            await self._step()
        while True:
            await asyncio.sleep(self.period_s)
            await self._step()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"rebalancer-{self.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)


class Persistence:
    """Metric windows and the dashboard's series on their way to SQL, kept through database
    faults (``WriteBuffer``); the history the dashboard starts with."""

    def __init__(self, *, sql: SqlGateway, live: LiveState, hub: DashboardHub, writes: WriteBuffer):
        self.sql = sql
        self.live = live
        self.hub = hub
        self.writes = writes  # metric windows on their way to SQL, kept through faults
        self.persisted_windows = 0

    def flush_metrics(self) -> int:
        """Write what the live state gathered since the last flush; returns rows written.
        Synchronous (tests, shutdown); the persist loop sends the same work to the gateway."""
        self.writes.add(self.live.drain_windows())
        return self.sql.call(lambda _s: self._write_windows())

    def _write_windows(self) -> int:
        # One transaction per job, rows kept through database faults (``WriteBuffer``).
        if not len(self.writes):
            return 0
        n = self.writes.write(self.sql.sessions).written
        self.persisted_windows += n
        return n

    def _write_all(self, s: Session, pending: list[Pending],
                   feeds: list[tuple[str, list[dict[str, Any]], dict[str, Any]]]) -> int:
        self.writes.add(aggregate_windows(pending))  # here, on the SQL thread: not on the loop
        if feeds:
            at = time.time()
            try:
                for job, points, summary in feeds:
                    insert_points(s, job, points, at)
                    save_summary(s, job, summary, at)
                s.commit()
            except Exception as exc:  # the dashboard's series; the metric windows go on below
                s.rollback()
                if not database_fault(exc):
                    raise
                report_fault(log, "storing the dashboard's series", exc)
        return self._write_windows()

    async def persist_now(self) -> int:
        """Store what live state and the hub gathered since the last call (gateway thread)."""
        pending = self.live.take_pending()  # swapped out on the loop, which owns live state
        feeds = self.hub.take_unsaved()
        if not pending and not feeds and not len(self.writes):
            return 0
        return await self.sql.run(lambda s: self._write_all(s, pending, feeds))

    async def persist_step(self) -> None:
        try:
            await self.persist_now()
        except Exception:  # a bug, not the database (the buffer keeps rows through faults)
            log.exception("persisting metrics failed; will retry")

    async def preload_history(self) -> None:
        """The dashboard's recent series and summaries, read back from SQL at start-up."""
        limit = self.hub.series_max

        def read(s: Session) -> list[tuple[str, list[dict[str, Any]], dict[str, Any] | None]]:
            return [(j.name, recent_points(s, j.name, limit), get_summary(s, j.name))
                    for j in list_jobs(s)]

        for job, points, summary in await self.sql.run(read):
            if points or summary:
                self.hub.preload(job, points, summary)

    def final_flush(self) -> None:
        """At shutdown: write what is left; say how many windows could not be written."""
        try:
            self.flush_metrics()
        except Exception:
            log.exception("final metrics flush failed")
        if len(self.writes):
            log.warning("%d metric windows could not be written before shutdown and are lost", len(self.writes))


class Retention:
    """Deletes metric history older than ``retention_days``."""

    def __init__(self, *, sql: SqlGateway, settings: Settings):
        self.sql = sql
        self.settings = settings

    async def apply_retention(self) -> int:
        """Delete metric history older than ``retention_days``; returns rows deleted."""
        cutoff = time.time() - self.settings.retention_days * 86400.0

        def work(s: Session) -> int:
            n = delete_older_than(s, cutoff)
            s.commit()
            return n

        return await self.sql.run(work)

    async def step(self) -> None:
        try:
            n = await self.apply_retention()
            if n:
                log.info("retention: deleted %d metric rows older than %g days", n,
                         self.settings.retention_days)
        except Exception:
            log.exception("deleting old metric history failed; will retry")


class Revocations:
    """Closes the sockets of tokens revoked since they opened (by this process or the CLI)."""

    def __init__(self, *, sql: SqlGateway, auth: AuthService, sockets: TokenSockets):
        self.sql = sql
        self.auth = auth
        self.sockets = sockets

    async def close_revoked(self) -> int:
        """Close the sockets of tokens revoked since they opened; returns how many closed."""
        ids = self.sockets.token_ids()
        if not ids:
            return 0
        revoked = await self.sql.run(lambda _s: self.auth.revoked_among(ids))
        closed = 0
        for token_id in sorted(revoked):
            closed += await self.sockets.close_token(token_id)
        return closed

    async def step(self) -> None:
        try:
            await self.close_revoked()
        except Exception:  # the database may be briefly away; sockets stay until next time
            log.exception("checking open sockets for revoked tokens failed; will retry")


class JobLifecycle:
    """A job's end and its leaving memory: the report of a run whose ranks all said goodbye,
    idle jobs forgotten (their history stays in SQL), room made for a new job."""

    def __init__(self, *, settings: Settings, sql: SqlGateway, live: LiveState, connections: HookConnections,
                 controller: Controller, hub: DashboardHub, reports: RunReports, persistence: Persistence):
        self.settings = settings
        self.sql = sql
        self.live = live
        self.connections = connections
        self.controller = controller
        self.hub = hub
        self.reports = reports
        self.persistence = persistence
        self._report_tasks: set[asyncio.Task[Any]] = set()

    async def summary(self, job: str) -> dict[str, Any] | None:
        """The run's summary: live while the hub has the job, else the stored one."""
        fresh = self.hub.run_summary(job)
        if fresh is not None:
            return fresh
        return await self.sql.run(lambda s: get_summary(s, job))

    async def store_report(self, job: str, *, reason: str, finished: bool) -> dict[str, Any] | None:
        """Persist what live state still holds, then build and store the job's report."""
        await self.persistence.persist_now()
        return await self.reports.store(job, reason=reason, finished=finished)

    def run_ended(self, job: str) -> None:
        """Every rank of ``job`` said goodbye: store its report in the background."""
        task = asyncio.get_running_loop().create_task(self._store_ended(job), name=f"rebalancer-report-{job}")
        self._report_tasks.add(task)
        task.add_done_callback(self._report_tasks.discard)

    async def _store_ended(self, job: str) -> None:
        # The last metrics frames came before the goodbyes; let the hub fold them into the
        # run's savings first (its next tick).
        await asyncio.sleep(2 * self.hub.interval_s)
        while True:
            try:
                await self.controller.run_ended(job)
                await self.store_report(job, reason=GOODBYE, finished=True)
                return
            except Exception as exc:
                if not database_fault(exc):
                    log.exception("storing the run report of job %s failed", job)
                    return
                # The database does not take writes now: try again until it does (the
                # report is built from what live state holds, which waits with it).
                report_fault(log, f"storing the run report of job {job}", exc)
            await asyncio.sleep(self.settings.health_interval_s)

    async def finish_reports(self) -> None:
        """At shutdown: let reports of runs that just ended finish (up to 10 s), then give up."""
        if self._report_tasks:
            await asyncio.wait(set(self._report_tasks), timeout=10)
            for t in list(self._report_tasks):  # still waiting for the database: give up
                await cancel_and_wait(t)

    def forget_job(self, job: str) -> bool:
        """Drop a job without connected ranks from memory (live state, control state, its
        dashboard feed); its history, placements and audit stay in SQL. False if it has
        ranks connected or an action in flight."""
        if self.connections.ranks(job) or not self.controller.forget(job):
            return False
        self.live.forget(job)
        self.hub.notify(job)  # the hub drops the feed of a job live state no longer has
        log.info("job %s left memory (no rank connected); its history stays in SQL", job)
        return True

    def forget_idle_jobs(self) -> list[str]:
        """Forget every job idle for ``forget_job_after_s``; returns those forgotten."""
        idle = self.live.idle_jobs(self.settings.forget_job_after_s)
        return [job for job in idle if self.forget_job(job)]

    def make_room(self, job: str) -> bool:
        """Whether a hello may add ``job`` to live state: it is live already, the cap is not
        reached, or a job without connected ranks (the longest idle) leaves to make room."""
        if job in self.live or self.live.job_count() < self.settings.max_live_jobs:
            return True
        return any(self.forget_job(j) for j in self.live.idle_jobs(0.0))

    async def forget_step(self) -> None:
        try:
            self.forget_idle_jobs()
        except Exception:
            log.exception("forgetting idle jobs failed; will retry")


class HandOver:
    """Several replicas: a job this replica took reloads its control state here; one another
    replica took while its hooks are connected here sends the hooks there."""

    def __init__(self, *, cluster: JobLeases, connections: HookConnections, controller: Controller,
                 hub: DashboardHub):
        self.cluster = cluster
        self.connections = connections
        self.controller = controller
        self.hub = hub
        self._handovers: set[asyncio.Task[None]] = set()
        cluster.watch(wanted=connections.jobs, on_gained=self.gained, on_lost=self.lost)

    def gained(self, job: str) -> None:
        """This replica took ``job``: reload its control state; its dashboards show our feed."""
        self.hub.drop_remote(job)
        self.controller.take_over(job)

    def lost(self, job: str) -> None:
        """Another replica took ``job`` while its hooks are connected here: send them there."""
        task = asyncio.create_task(self._redirect_hooks(job), name=f"rebalancer-hand-over-{job}")
        self._handovers.add(task)  # held until done (the loop keeps only weak references)
        task.add_done_callback(self._handovers.discard)

    async def _redirect_hooks(self, job: str) -> None:
        _, url = await self.cluster.owner(job)
        if url:
            await self.connections.redirect_job(job, url)
        else:
            await self.connections.close_job(job, CLOSE_TRY_AGAIN_LATER,
                                             f"job '{job}' is controlled by another replica")


class Background:
    """Starts and stops everything one app runs besides its requests, in order: the history
    preload, the leases, the controller's and the hub's tickers, the fan-out, then the five
    loops (persist, revocations, retention, storage health, forget); ``stop`` the reverse,
    ending with a last flush of metrics and the database closed."""

    def __init__(self, *, settings: Settings, engine: Engine, sql: SqlGateway, storage: StorageHealth,
                 controller: Controller, hub: DashboardHub, persistence: Persistence, retention: Retention,
                 revocations: Revocations, lifecycle: JobLifecycle, auth_cache_s: float,
                 cluster: JobLeases | None = None, fanout: LiveFanout | None = None,
                 forwarder: Forwarder | None = None):
        self.engine = engine
        self.sql = sql
        self.controller = controller
        self.hub = hub
        self.persistence = persistence
        self.lifecycle = lifecycle
        self.cluster = cluster
        self.fanout = fanout
        self.forwarder = forwarder

        async def check_storage() -> None:
            # Finds faults (and recoveries) while nobody asks /healthz: a deleted SQLite file
            # is restored here, and a pool opened during a fault is recycled when it ends.
            await sql.run(lambda _s: storage.check())

        self.loops = [
            Every("persist", settings.persist_interval_s, persistence.persist_step),
            # Revocations by another process (the CLI) reach open sockets within this period.
            Every("revocations", auth_cache_s, revocations.step),
            Every("retention", settings.retention_interval_s, retention.step, first_now=True),
            Every("storage-health", settings.health_interval_s, check_storage),
            Every("forget", min(max(settings.forget_job_after_s / 4, 0.5), 30.0), lifecycle.forget_step),
        ]

    async def start(self) -> None:
        await self.persistence.preload_history()
        if self.cluster is not None:
            await self.cluster.start()
        await self.controller.start()
        await self.hub.start()
        if self.fanout is not None:
            await self.fanout.start()
        for loop in self.loops:
            loop.start()

    async def stop(self) -> None:
        await self.lifecycle.finish_reports()  # reports of runs that just ended
        for part in (self.fanout, self.hub, self.controller):
            if part is not None:
                with contextlib.suppress(Exception):
                    await part.stop()
        if self.forwarder is not None:
            with contextlib.suppress(Exception):
                await self.forwarder.aclose()
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                await self.cluster.stop()
        for loop in self.loops:
            await loop.stop()
        self.persistence.final_flush()
        self.sql.close()
        self.engine.dispose()

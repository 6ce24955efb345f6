"""The parts of one backend app, built once by ``build_parts(settings)`` and handed to each
part by its constructor (typed, all required; nothing is looked up at run time).

Who owns what: the event loop owns live state (``LiveState``) and control state (the
``Controller``'s per-job state and snapshots); SQL runs on the ``SqlGateway`` thread; policy
decisions run in the ``PolicyRunner`` (a worker process). ``Parts.start``/``stop`` run the
background loops: persisting metric windows, closing sockets of revoked tokens, deleting
history older than the retention, and the controller's and the hub's own tickers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from backend.auth.sockets import TokenSockets
from backend.auth.tokens import AuthService
from backend.control.controller import Controller
from backend.control.policy_runs import PolicyRunner
from backend.dashboard.hub import DashboardHub, JobChanges
from backend.live.state import LiveState
from backend.live.windows import Pending, aggregate_windows
from backend.metrics_export import MetricsExporter
from backend.peers.connections import HookConnections
from backend.report.collect import GOODBYE, RunReports
from backend.settings import Settings
from backend.storage import (
    RankMetricRow,
    insert_windows,
    list_jobs,
    make_engine,
    make_sessionmaker,
)
from backend.storage.gateway import SqlGateway
from backend.storage.health import StorageHealth, report_fault
from backend.storage.migrations import upgrade
from backend.storage.summaries import (
    delete_older_than,
    get_summary,
    insert_points,
    recent_points,
    save_summary,
)
from backend.storage.writes import WriteBuffer, database_fault
from rebalancer_wire.protocol import CLOSE_TRY_AGAIN_LATER

if TYPE_CHECKING:
    from backend.cluster import Forwarder, JobLeases, LiveFanout

__all__ = ["Parts", "build_parts", "init_db"]

log = logging.getLogger("rebalancer")


def init_db(engine: Engine) -> None:
    """Bring the database to the newest schema (Alembic migrations; creates a new one)."""
    upgrade(engine)


class Parts:
    """Everything one app's requests and background tasks use."""

    def __init__(self, *, settings: Settings, engine: Engine, sql: SqlGateway, live: LiveState,
                 connections: HookConnections, auth: AuthService, sockets: TokenSockets,
                 controller: Controller, hub: DashboardHub, reports: RunReports,
                 exporter: MetricsExporter, writes: WriteBuffer, storage: StorageHealth,
                 cluster: JobLeases | None = None, fanout: LiveFanout | None = None,
                 forwarder: Forwarder | None = None):
        self.settings = settings
        self.engine = engine
        self.sql = sql
        self.live = live
        self.connections = connections
        self.auth = auth
        self.sockets = sockets
        self.controller = controller
        self.hub = hub
        self.writes = writes  # metric windows on their way to SQL, kept through faults
        self.storage = storage  # whether the database takes writes (/healthz)
        self.cluster = cluster  # job leases on Redis; None: one replica (the default)
        self.fanout = fanout  # other owners' dashboards shown here, ours stored for them
        self.forwarder = forwarder  # operator actions sent on to a job's owner; None: 409
        if cluster is not None:
            cluster.watch(wanted=connections.jobs, on_gained=self._gained, on_lost=self._hand_over)
        self.reports = reports
        self.exporter = exporter
        self.persisted_windows = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._report_tasks: set[asyncio.Task[Any]] = set()
        self._handovers: set[asyncio.Task[None]] = set()

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

    async def _persist_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.persist_interval_s)
            try:
                await self.persist_now()
            except Exception:  # a bug, not the database (the buffer keeps rows through faults)
                log.exception("persisting metrics failed; will retry")

    async def _health_loop(self) -> None:
        # Finds faults (and recoveries) while nobody asks /healthz: a deleted SQLite file is
        # restored here, and a pool opened during a fault is recycled when it ends.
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            await self.sql.run(lambda _s: self.storage.check())

    async def summary(self, job: str) -> dict[str, Any] | None:
        """The run's summary: live while the hub has the job, else the stored one."""
        fresh = self.hub.run_summary(job)
        if fresh is not None:
            return fresh
        return await self.sql.run(lambda s: get_summary(s, job))

    async def store_report(self, job: str, *, reason: str, finished: bool) -> dict[str, Any] | None:
        """Persist what live state still holds, then build and store the job's report."""
        await self.persist_now()
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

    async def _preload_history(self) -> None:
        limit = self.hub.series_max

        def read(s: Session) -> list[tuple[str, list[dict[str, Any]], dict[str, Any] | None]]:
            return [(j.name, recent_points(s, j.name, limit), get_summary(s, j.name))
                    for j in list_jobs(s)]

        for job, points, summary in await self.sql.run(read):
            if points or summary:
                self.hub.preload(job, points, summary)

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

    async def _revocation_loop(self) -> None:
        # Revocations by another process (the CLI) reach open sockets within this period.
        while True:
            await asyncio.sleep(self.auth.cache_s)
            try:
                await self.close_revoked()
            except Exception:  # the database may be briefly away; sockets stay until next time
                log.exception("checking open sockets for revoked tokens failed; will retry")

    async def apply_retention(self) -> int:
        """Delete metric history older than ``retention_days``; returns rows deleted."""
        cutoff = time.time() - self.settings.retention_days * 86400.0

        def work(s: Session) -> int:
            n = delete_older_than(s, cutoff)
            s.commit()
            return n

        return await self.sql.run(work)

    async def _retention_loop(self) -> None:
        while True:
            try:
                n = await self.apply_retention()
                if n:
                    log.info("retention: deleted %d metric rows older than %g days", n,
                             self.settings.retention_days)
            except Exception:
                log.exception("deleting old metric history failed; will retry")
            await asyncio.sleep(self.settings.retention_interval_s)

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

    def _gained(self, job: str) -> None:
        """This replica took ``job``: reload its control state; its dashboards show our feed."""
        self.hub.drop_remote(job)
        self.controller.take_over(job)

    def _hand_over(self, job: str) -> None:
        """Another replica took ``job`` while its hooks are connected here: send them there."""
        task = asyncio.create_task(self._redirect_hooks(job), name=f"rebalancer-hand-over-{job}")
        self._handovers.add(task)  # held until done (the loop keeps only weak references)
        task.add_done_callback(self._handovers.discard)

    async def _redirect_hooks(self, job: str) -> None:
        assert self.cluster is not None
        _, url = await self.cluster.owner(job)
        if url:
            await self.connections.redirect_job(job, url)
        else:
            await self.connections.close_job(job, CLOSE_TRY_AGAIN_LATER,
                                             f"job '{job}' is controlled by another replica")

    def make_room(self, job: str) -> bool:
        """Whether a hello may add ``job`` to live state: it is live already, the cap is not
        reached, or a job without connected ranks (the longest idle) leaves to make room."""
        if job in self.live or self.live.job_count() < self.settings.max_live_jobs:
            return True
        return any(self.forget_job(j) for j in self.live.idle_jobs(0.0))

    async def _forget_loop(self) -> None:
        period = min(max(self.settings.forget_job_after_s / 4, 0.5), 30.0)
        while True:
            await asyncio.sleep(period)
            try:
                self.forget_idle_jobs()
            except Exception:
                log.exception("forgetting idle jobs failed; will retry")

    async def start(self) -> None:
        await self._preload_history()
        if self.cluster is not None:
            await self.cluster.start()
        await self.controller.start()
        await self.hub.start()
        if self.fanout is not None:
            await self.fanout.start()
        for coro, name in ((self._persist_loop(), "persist"), (self._revocation_loop(), "revocations"),
                           (self._retention_loop(), "retention"), (self._health_loop(), "storage-health"),
                           (self._forget_loop(), "forget")):
            self._tasks.append(asyncio.create_task(coro, name=f"rebalancer-{name}"))

    async def stop(self) -> None:
        if self._report_tasks:  # reports of runs that just ended: let them finish
            await asyncio.wait(set(self._report_tasks), timeout=10)
            for t in list(self._report_tasks):  # still waiting for the database: give up
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
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
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        try:
            self.flush_metrics()
        except Exception:
            log.exception("final metrics flush failed")
        if len(self.writes):
            log.warning("%d metric windows could not be written before shutdown and are lost", len(self.writes))
        self.sql.close()
        self.engine.dispose()


def build_parts(settings: Settings, *, policy: PolicyRunner | None = None,
                clock: Callable[[], float] = time.monotonic,
                wall: Callable[[], float] = time.time) -> Parts:
    """Every part of one app, wired. ``policy``: the runner to use (tests pass their own
    decide function through it); ``clock``/``wall``: the controller's clocks."""
    engine = make_engine(settings.db)
    init_db(engine)
    sessions = make_sessionmaker(engine)
    sql = SqlGateway(sessions)
    auth = AuthService(sessions, loopback=settings.loopback)
    if settings.admin_token is not None:
        auth.ensure_admin(settings.admin_token.get_secret_value())
    live = LiveState(step_buffer=settings.step_buffer, device_buffer=settings.device_buffer,
                     window_steps=settings.window_steps)
    connections = HookConnections()
    cluster = _cluster(settings)
    changes = JobChanges()  # jobs whose dashboard feed is due: the controller and ingest mark
    controller = Controller(
        settings=settings, sql=sql, live=live, connections=connections, notify=changes.mark,
        policy=policy if policy is not None else PolicyRunner(process=settings.policy_process),
        clock=clock, wall=wall, ownership=cluster)
    hub = DashboardHub(settings=settings, live=live, control=controller.job_control,
                       cost_fit=controller.cost_fit, changes=changes)
    writes = WriteBuffer(write_rows=insert_windows, job_of=lambda w: w.job,
                         max_windows=settings.persist_buffer_windows)
    storage = StorageHealth(engine, probe_table=RankMetricRow.__tablename__)
    fanout, forwarder = _cluster_links(settings, cluster, hub)
    exporter = MetricsExporter(live=live, connections=connections, controller=controller, hub=hub,
                               settings=settings, writes=writes, storage=storage, fanout=fanout,
                               forwarder=forwarder)
    reports = RunReports(sql=sql, controller=controller, hub=hub, settings=settings, live=live)
    return Parts(settings=settings, engine=engine, sql=sql, live=live, connections=connections,
                 auth=auth, sockets=TokenSockets(), controller=controller, hub=hub, reports=reports,
                 exporter=exporter, writes=writes, storage=storage, cluster=cluster, fanout=fanout,
                 forwarder=forwarder)


def _cluster(settings: Settings) -> JobLeases | None:
    if settings.redis_url is None:
        return None
    from backend.cluster import JobLeases  # the 'cluster' extra (redis) is needed only here

    advertise = settings.advertise_url or f"ws://{settings.host}:{settings.port}"
    return JobLeases(url=settings.redis_url, prefix=settings.redis_prefix, advertise_url=advertise,
                     ttl_s=settings.lease_ttl_s)


def _cluster_links(settings: Settings, cluster: JobLeases | None,
                   hub: DashboardHub) -> tuple[LiveFanout | None, Forwarder | None]:
    if cluster is None or settings.redis_url is None:
        return None, None
    from backend.cluster import Forwarder, LiveFanout

    fanout = LiveFanout(url=settings.redis_url, prefix=settings.redis_prefix, replica_id=cluster.replica_id,
                        interval_s=settings.fanout_interval_s, hub=hub, owned=cluster.owned_jobs)
    forwarder = (Forwarder(replica_id=cluster.replica_id, timeout_s=settings.forward_timeout_s)
                 if settings.forward_actions else None)
    return fanout, forwarder

"""The parts of one backend app, built once by ``build_parts(settings)`` and handed to each
part by its constructor (typed, all required; nothing is looked up at run time). This module
only builds: what runs in the background (persisting metric windows, closing sockets of
revoked tokens, deleting old history, storage health, forgetting idle jobs, run reports and
the cluster hand-over) is ``backend.loops``'s, started and stopped by ``Background``.

Who owns what: the event loop owns live state (``LiveState``) and control state (the
``Controller``'s ``JobStore``); SQL runs on the ``SqlGateway`` thread; policy decisions run
in the ``PolicyRunner`` (a worker process).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import Engine

from backend.auth.sockets import TokenSockets
from backend.auth.tokens import AuthService
from backend.control.controller import Controller
from backend.control.policy_runs import PolicyRunner
from backend.dashboard.hub import DashboardHub, JobChanges
from backend.live.state import LiveState
from backend.loops import Background, HandOver, JobLifecycle, Persistence, Retention, Revocations
from backend.metrics_export import MetricsExporter
from backend.peers.connections import HookConnections
from backend.report.collect import RunReports
from backend.settings import Settings
from backend.storage import (
    RankMetricRow,
    insert_windows,
    make_engine,
    make_sessionmaker,
)
from backend.storage.gateway import SqlGateway
from backend.storage.health import StorageHealth
from backend.storage.hellos import HelloWriter
from backend.storage.migrations import upgrade
from backend.storage.writes import WriteBuffer

if TYPE_CHECKING:
    from backend.cluster import Forwarder, JobLeases, LiveFanout

__all__ = ["Parts", "build_parts", "init_db"]


def init_db(engine: Engine) -> None:
    """Bring the database to the newest schema (Alembic migrations; creates a new one)."""
    upgrade(engine)


@dataclass(kw_only=True, eq=False)
class Parts:
    """Everything one app's requests and background tasks use. The methods forward to the
    background jobs (``backend.loops``) that the routes and ingest call."""

    settings: Settings
    engine: Engine
    sql: SqlGateway
    hellos: HelloWriter  # hellos' rows stored by the batch (ingest)
    live: LiveState
    connections: HookConnections
    auth: AuthService
    sockets: TokenSockets
    controller: Controller
    hub: DashboardHub
    reports: RunReports
    exporter: MetricsExporter
    writes: WriteBuffer  # metric windows on their way to SQL, kept through faults
    storage: StorageHealth  # whether the database takes writes (/healthz)
    persistence: Persistence
    lifecycle: JobLifecycle
    revocations: Revocations
    background: Background
    cluster: JobLeases | None = None  # job leases on Redis; None: one replica (the default)
    fanout: LiveFanout | None = None  # other owners' dashboards shown here, ours stored for them
    forwarder: Forwarder | None = None  # operator actions sent on to a job's owner; None: 409
    hand_over: HandOver | None = None  # a job another replica took: its hooks sent there

    def __post_init__(self) -> None:
        # What the routes, ingest and the tests call, forwarded (written once, here).
        self.flush_metrics = self.persistence.flush_metrics
        self.persist_now = self.persistence.persist_now
        self.close_revoked = self.revocations.close_revoked
        self.summary = self.lifecycle.summary
        self.store_report = self.lifecycle.store_report
        self.run_ended = self.lifecycle.run_ended
        self.make_room = self.lifecycle.make_room
        self.forget_job = self.lifecycle.forget_job
        self.forget_idle_jobs = self.lifecycle.forget_idle_jobs
        self.start = self.background.start
        self.stop = self.background.stop


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
                       cost_fit=controller.cost_fit, changes=changes,
                       owner=None if cluster is None else {"replica_id": cluster.replica_id,
                                                           "url": cluster.advertise_url})
    writes = WriteBuffer(write_rows=insert_windows, job_of=lambda w: w.job,
                         max_windows=settings.persist_buffer_windows)
    storage = StorageHealth(engine, probe_table=RankMetricRow.__tablename__)
    fanout, forwarder = _cluster_links(settings, cluster, hub)
    exporter = MetricsExporter(live=live, connections=connections, controller=controller, hub=hub,
                               settings=settings, writes=writes, storage=storage, fanout=fanout,
                               forwarder=forwarder)
    reports = RunReports(sql=sql, controller=controller, hub=hub, settings=settings, live=live)
    sockets = TokenSockets()
    persistence = Persistence(sql=sql, live=live, hub=hub, writes=writes)
    lifecycle = JobLifecycle(settings=settings, sql=sql, live=live, connections=connections,
                             controller=controller, hub=hub, reports=reports, persistence=persistence)
    revocations = Revocations(sql=sql, auth=auth, sockets=sockets)
    hand_over = (HandOver(cluster=cluster, connections=connections, controller=controller, hub=hub)
                 if cluster is not None else None)
    background = Background(
        settings=settings, engine=engine, sql=sql, storage=storage, controller=controller, hub=hub,
        persistence=persistence, retention=Retention(sql=sql, settings=settings), revocations=revocations,
        lifecycle=lifecycle, auth_cache_s=auth.cache_s, cluster=cluster, fanout=fanout, forwarder=forwarder)
    return Parts(settings=settings, engine=engine, sql=sql, hellos=HelloWriter(sql), live=live,
                 connections=connections, auth=auth, sockets=sockets, controller=controller, hub=hub, reports=reports,
                 exporter=exporter, writes=writes, storage=storage, persistence=persistence,
                 lifecycle=lifecycle, revocations=revocations, background=background, cluster=cluster,
                 fanout=fanout, forwarder=forwarder, hand_over=hand_over)


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

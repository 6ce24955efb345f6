"""The container of everything a request or a background task needs, on ``app.state.services``.

``build_services(settings)`` creates the engine, tables, live state, connections and auth;
``create_app`` then adds the controller and the dashboard hub, which take the container
itself (``Controller(services)``, ``DashboardHub(services)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from backend.auth.sockets import TokenSockets
from backend.auth.tokens import AuthService
from backend.ingest.connections import HookConnections
from backend.live.state import LiveState
from backend.settings import Settings
from backend.storage import Base, RankMetricRow, insert_windows, make_engine, make_sessionmaker
from backend.storage.health import StorageHealth
from backend.storage.writes import WriteBuffer

__all__ = ["Services", "build_services", "init_db"]

log = logging.getLogger("rebalancer")


def init_db(engine: Engine) -> None:
    """Create every table the backend knows (metrics, tokens, and control if installed)."""
    import backend.auth.tokens  # noqa: F401  (registers auth_tokens)
    import backend.storage.metrics  # noqa: F401

    try:
        importlib.import_module("backend.storage.control")
    except ModuleNotFoundError as exc:
        if exc.name != "backend.storage.control":
            raise
    Base.metadata.create_all(engine)


@dataclass
class Services:
    """Shared state of one app. ``controller`` and ``hub`` are set by ``create_app``."""

    settings: Settings
    engine: Engine
    sessionmaker: sessionmaker
    live: LiveState
    connections: HookConnections
    auth: AuthService
    writes: WriteBuffer  # metric windows on their way to SQL
    storage: StorageHealth  # whether the database takes writes
    controller: Any = None
    hub: Any = None
    registry: Any = None  # prometheus CollectorRegistry, set by backend.api.routes.metrics
    persisted_windows: int = 0
    sockets: TokenSockets = field(default_factory=TokenSockets)  # open websockets by token
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def notify(self, job: str) -> None:
        """Tell the dashboard hub that a job changed (no-op without a hub)."""
        if self.hub is not None:
            self.hub.notify(job)

    def flush_metrics(self) -> int:
        """Write what the live state gathered since the last flush, and what earlier flushes
        could not write, one job per transaction (``WriteBuffer``); returns rows written."""
        self.writes.add(self.live.drain_windows())
        if not len(self.writes):
            return 0
        n = self.writes.write(self.sessionmaker).written
        self.persisted_windows += n
        return n

    async def _persist_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.persist_interval_s)
            try:
                await asyncio.to_thread(self.flush_metrics)
            except Exception:  # a bug, not the database (the buffer keeps rows through faults)
                log.exception("persisting metrics failed; will retry")

    async def _health_loop(self) -> None:
        # Finds faults (and recoveries) while nobody asks /healthz: a deleted SQLite file is
        # restored here, and a pool opened during a fault is recycled when it ends.
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            await asyncio.to_thread(self.storage.check)

    async def close_revoked(self) -> int:
        """Close the sockets of tokens revoked since they opened; returns how many closed."""
        ids = self.sockets.token_ids()
        if not ids:
            return 0
        revoked = await asyncio.to_thread(self.auth.revoked_among, ids)
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

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._persist_loop(), name="rebalancer-persist"))
        self._tasks.append(asyncio.create_task(self._revocation_loop(), name="rebalancer-revocations"))
        self._tasks.append(asyncio.create_task(self._health_loop(), name="rebalancer-storage-health"))
        for part in (self.controller, self.hub):
            if part is not None:
                await part.start()

    async def stop(self) -> None:
        for part in (self.hub, self.controller):
            if part is not None:
                with contextlib.suppress(Exception):
                    await part.stop()
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
        self.storage.close()
        self.engine.dispose()


def build_services(settings: Settings) -> Services:
    engine = make_engine(settings.db)
    init_db(engine)
    sf = make_sessionmaker(engine)
    auth = AuthService(sf, loopback=settings.loopback)
    if settings.admin_token is not None:
        auth.ensure_admin(settings.admin_token.get_secret_value())
    writes = WriteBuffer(write_rows=insert_windows, job_of=lambda w: w.job,
                         max_windows=settings.persist_buffer_windows)
    storage = StorageHealth(engine, probe_table=RankMetricRow.__tablename__)
    return Services(
        settings=settings, engine=engine, sessionmaker=sf, writes=writes, storage=storage,
        live=LiveState(step_buffer=settings.step_buffer, device_buffer=settings.device_buffer,
                       window_steps=settings.window_steps),
        connections=HookConnections(), auth=auth,
    )

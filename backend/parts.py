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
from backend.storage import Base, insert_windows, make_engine, make_sessionmaker

__all__ = ["Services", "build_services", "init_db"]

log = logging.getLogger("rebalancer")


def init_db(engine: Engine) -> None:
    """Create every table the backend knows (metrics, tokens, and control if installed)."""
    import backend.auth.tokens  # noqa: F401  (registers auth_tokens)
    import backend.storage.metrics  # noqa: F401
    import backend.storage.reports  # noqa: F401

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
    controller: Any = None
    hub: Any = None
    reports: Any = None  # backend.report.collect.RunReports, set by create_app
    registry: Any = None  # prometheus CollectorRegistry, set by backend.api.routes.metrics
    persisted_windows: int = 0
    sockets: TokenSockets = field(default_factory=TokenSockets)  # open websockets by token
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def notify(self, job: str) -> None:
        """Tell the dashboard hub that a job changed (no-op without a hub)."""
        if self.hub is not None:
            self.hub.notify(job)

    def flush_metrics(self) -> int:
        """Write what the live state gathered since the last flush; returns rows written."""
        windows = self.live.drain_windows()
        if not windows:
            return 0
        with self.sessionmaker() as s:
            n = insert_windows(s, windows)
            s.commit()
        self.persisted_windows += n
        return n

    async def _persist_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.persist_interval_s)
            try:
                await asyncio.to_thread(self.flush_metrics)
            except Exception:  # the database may be briefly away; keep the live path serving
                log.exception("persisting metrics failed; will retry")

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
        for part in (self.controller, self.hub):
            if part is not None:
                await part.start()

    async def stop(self) -> None:
        for part in (self.reports, self.hub, self.controller):
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
        self.engine.dispose()


def build_services(settings: Settings) -> Services:
    engine = make_engine(settings.db)
    init_db(engine)
    sf = make_sessionmaker(engine)
    auth = AuthService(sf, loopback=settings.loopback)
    if settings.admin_token is not None:
        auth.ensure_admin(settings.admin_token.get_secret_value())
    return Services(
        settings=settings, engine=engine, sessionmaker=sf,
        live=LiveState(step_buffer=settings.step_buffer, device_buffer=settings.device_buffer,
                       window_steps=settings.window_steps),
        connections=HookConnections(), auth=auth,
    )

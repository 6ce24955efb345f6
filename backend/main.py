"""``create_app``: wires settings, services, routers and background tasks. Nothing else."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI

from backend.api.routes import audit, control, docs, health, jobs, metrics, pages, report, tokens
from backend.control.controller import Controller
from backend.dashboard.hub import DashboardHub
from backend.ingest import websocket as ingest
from backend.parts import Services, build_services
from backend.report.collect import RunReports
from backend.settings import Settings

__all__ = ["create_app"]

log = logging.getLogger("rebalancer")


# Every router, listed: the hook websocket, then one per REST resource and the dashboard's pages.
ROUTERS: tuple[APIRouter, ...] = (
    ingest.router, metrics.router, audit.router, control.router, docs.router, health.router,
    jobs.router, pages.router, report.router, tokens.router,
)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the backend app. Tables are created and the admin token ensured right here;
    background tasks (persistence, controller tick, hub pushers) run during the lifespan."""
    settings = settings or Settings()
    services: Services = build_services(settings)
    services.controller = Controller(services)
    services.hub = DashboardHub(services)
    services.reports = RunReports(
        sessionmaker=services.sessionmaker, live=services.live, controller=services.controller,
        hub=services.hub, settings=settings, flush=services.flush_metrics)
    services.registry = metrics.make_registry(
        live=services.live, connections=services.connections, controller=services.controller,
        hub=services.hub, settings=settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not settings.loopback and services.auth.token_count() == 0:
            # The CLI refuses earlier; this covers apps served some other way.
            raise RuntimeError(
                f"Refusing to serve on {settings.host} with no access tokens. Create an admin token "
                f"first: rebalancer token create --role admin --db {settings.db}")
        if services.auth.open_mode:
            log.warning(
                "OPEN MODE: no access tokens exist and the server is bound to loopback (%s), so every "
                "caller is admin. Create one to require tokens: rebalancer token create --role admin --db %s",
                settings.host, settings.db)
        else:
            log.info("access control on: bearer tokens required")
        await services.start()
        try:
            yield
        finally:
            await services.stop()

    app = FastAPI(
        title="Rebalancer",
        version="0.1.0",
        summary="Live rebalancing of the global batch across heterogeneous data-parallel ranks.",
        lifespan=lifespan,
        docs_url=None,  # /docs comes from routes/docs.py with local assets
        redoc_url=None,
    )
    app.state.services = services
    app.state.settings = settings
    for router in ROUTERS:  # pages includes /ws/dashboard (the hub's feed)
        app.include_router(router)

    return app

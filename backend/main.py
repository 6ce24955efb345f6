"""``create_app``: wires settings, services, routers and background tasks. Nothing else."""

from __future__ import annotations

import contextlib
import importlib
import logging
import pkgutil
from collections.abc import AsyncIterator

from fastapi import FastAPI

import backend.api.routes as routes_pkg
from backend import ingest, prom
from backend.services import Services, build_services
from backend.settings import Settings

__all__ = ["create_app"]

log = logging.getLogger("rebalancer")


def _optional(module: str, attr: str) -> type | None:
    """A class from another part of the backend, or None while that part is not installed."""
    try:
        return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        log.warning("%s is not installed; running without it", module)
        return None


def _include_routes(app: FastAPI) -> None:
    # One APIRouter per resource: every module under backend/api/routes with a `router`.
    for info in sorted(pkgutil.iter_modules(routes_pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{routes_pkg.__name__}.{info.name}")
        router = getattr(module, "router", None)
        if router is not None:
            app.include_router(router)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the backend app. Tables are created and the admin token ensured right here;
    background tasks (persistence, controller tick, hub pushers) run during the lifespan."""
    settings = settings or Settings()
    services: Services = build_services(settings)
    controller_cls = _optional("backend.controller", "Controller")
    hub_cls = _optional("backend.hub", "DashboardHub")
    services.controller = controller_cls(services) if controller_cls else None
    services.hub = hub_cls(services) if hub_cls else None
    services.registry = prom.make_registry(services)

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
    app.include_router(ingest.router)
    app.include_router(prom.router)
    _include_routes(app)  # includes /ws/dashboard from routes/pages.py (the hub's feed)

    return app

"""``create_app``: wires settings, services, routers and background tasks. Nothing else."""

from __future__ import annotations

import contextlib
import importlib
import logging
import pkgutil
from collections.abc import AsyncIterator

from fastapi import FastAPI, WebSocket

import backend.api.routes as routes_pkg
from backend import ingest, prom
from backend.api.deps import websocket_actor
from backend.auth import role_allows
from backend.services import Services, build_services
from backend.settings import Settings
from trainer_hook.protocol import CLOSE_FORBIDDEN, CLOSE_UNAUTHORIZED, Error, encode

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
    )
    app.state.services = services
    app.state.settings = settings
    app.include_router(ingest.router)
    app.include_router(prom.router)
    _include_routes(app)

    @app.websocket("/ws/dashboard")
    async def dashboard_websocket(websocket: WebSocket) -> None:
        """Live dashboard updates (viewer role); ``?job=NAME`` for one job, none for the list."""
        actor = websocket_actor(websocket)
        refusal = None
        if actor is None:
            refusal = ("unauthorized", "Missing or invalid token; pass '?token=TOKEN'.", CLOSE_UNAUTHORIZED)
        elif not role_allows(actor.role, "viewer"):
            refusal = ("forbidden", "The dashboard needs the viewer role.", CLOSE_FORBIDDEN)
        elif services.hub is None:
            refusal = ("unavailable", "The dashboard hub is not installed in this backend.", 1011)
        if refusal is not None:
            await websocket.accept()
            with contextlib.suppress(Exception):
                await websocket.send_text(encode(Error(code=refusal[0], message=refusal[1])))
                await websocket.close(refusal[2], reason=refusal[1])
            return
        await services.hub.serve(websocket, websocket.query_params.get("job") or None, actor)

    return app

"""``create_app``: wires settings, the parts, the routers and the lifespan. Nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI

from backend import heap
from backend.api.edge import Edge
from backend.api.errors import install_error_handlers
from backend.api.openapi import install_openapi
from backend.api.routes import (
    audit,
    causes,
    control,
    docs,
    fleet,
    health,
    hook,
    identity,
    jobs,
    memory,
    metrics,
    pages,
    pipeline,
    report,
    tokens,
)
from backend.parts import Parts, build_parts
from backend.settings import Settings
from backend.tasks import cancel_and_wait

__all__ = ["create_app"]

log = logging.getLogger("rebalancer")


# Every router, listed: the hook websocket, then one per REST resource and the dashboard's pages.
ROUTERS: tuple[APIRouter, ...] = (
    hook.router, metrics.router, audit.router, control.router, docs.router, fleet.router, health.router,
    identity.router, jobs.router, causes.router, memory.router, pipeline.router, pages.router, report.router,
    tokens.router,
)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the backend app. Tables are created and the admin token ensured right here;
    background tasks (persistence, controller tick, hub pushers) run during the lifespan."""
    settings = settings or Settings()
    parts: Parts = build_parts(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not settings.loopback and parts.auth.token_count() == 0:
            # The CLI refuses earlier; this covers apps served some other way.
            raise RuntimeError(
                f"Refusing to serve on {settings.host} with no access tokens. Create an admin token "
                f"first: rebalancer token create --role admin --db {settings.db}")
        if parts.auth.open_mode:
            log.warning(
                "OPEN MODE: no access tokens exist and the server is bound to loopback (%s), so every "
                "caller is admin. Create one to require tokens: rebalancer token create --role admin --db %s",
                settings.host, settings.db)
        else:
            log.info("access control on: bearer tokens required")
        await parts.start()
        if settings.gc_freeze:
            heap.freeze()
        thresholds, collector = None, None
        if settings.gc_full_interval_s > 0:
            thresholds = heap.collect_on_schedule()
            collector = asyncio.create_task(heap.full_collections(settings.gc_full_interval_s),
                                            name="rebalancer-gc")
        try:
            yield
        finally:
            await cancel_and_wait(collector)
            if thresholds is not None:
                gc.set_threshold(*thresholds)
            await parts.stop()

    app = FastAPI(
        title="Rebalancer",
        version="0.1.0",
        summary="Live rebalancing of the global batch across heterogeneous data-parallel ranks.",
        lifespan=lifespan,
        docs_url=None,  # /docs comes from routes/docs.py with local assets
        redoc_url=None,
    )
    app.state.parts = parts
    app.state.settings = settings
    install_error_handlers(app)
    install_openapi(app)
    for router in ROUTERS:  # pages includes /ws/dashboard (the hub's feed)
        app.include_router(router)
    app.mount("/static", pages.FrontendFiles(), name="static")  # after /static/plotly.min.js
    app.add_middleware(Edge, max_body_bytes=settings.max_body_bytes)

    return app

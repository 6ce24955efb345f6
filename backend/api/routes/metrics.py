"""``GET /metrics``: the Prometheus exposition of ``backend.metrics_export``.

Access (``REBALANCER_METRICS_ACCESS``): ``token`` asks for a bearer token with at least the
viewer role (create a dedicated one for the scraper); ``loopback`` also answers callers on
this machine without a token (a Prometheus beside the backend), and still asks others for one
(``backend.api.deps.may_scrape``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from backend.api.deps import PartsDep, may_scrape
from backend.metrics_export import CONTENT_TYPE

__all__ = ["router"]

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request, parts: PartsDep) -> Response:
    """Prometheus exposition of live state; see the module's docstring for who may scrape."""
    may_scrape(request, parts)
    # A plain def: Starlette runs it on its thread pool, never on the event loop.
    return Response(parts.exporter.body(), media_type=CONTENT_TYPE)

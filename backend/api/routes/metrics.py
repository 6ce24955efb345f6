"""``GET /metrics``: the Prometheus exposition of ``backend.metrics_export``.

Access (``REBALANCER_METRICS_ACCESS``): ``token`` asks for a bearer token with at least the
viewer role (create a dedicated one for the scraper); ``loopback`` also answers callers on
this machine without a token (a Prometheus beside the backend), and still asks others for one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, HTTPException, Request, Response, status

from backend.api.deps import PartsDep, bearer_secret
from backend.auth.tokens import role_allows
from backend.metrics_export import CONTENT_TYPE
from backend.settings import is_loopback

if TYPE_CHECKING:
    from backend.parts import Parts

__all__ = ["router"]

router = APIRouter()


def _may_scrape(request: Request, parts: Parts) -> None:
    address = request.client.host if request.client else None
    secret = bearer_secret(request.headers)
    if secret is None and parts.settings.metrics_access == "loopback" and address and is_loopback(address):
        return
    actor = parts.auth.authenticate(secret, address)
    if actor is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "Missing or invalid bearer token.",
                            headers={"WWW-Authenticate": "Bearer"})
    if not role_allows(actor.role, "viewer"):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "This action needs the viewer role.")


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request, parts: PartsDep) -> Response:
    """Prometheus exposition of live state; see the module's docstring for who may scrape."""
    _may_scrape(request, parts)
    return Response(parts.exporter.exposition(), media_type=CONTENT_TYPE)

"""The dashboard's pages, static files, its websocket, and two small reads it needs.

- ``GET /``: jobs overview; ``GET /job/{job}``: job view (both plain HTML from frontend/).
- ``GET /static/plotly.min.js``: served from the installed ``plotly`` package (no CDN).
- ``GET /static/{path}``: the rest of frontend/ (ES modules, CSS).
- ``WS /ws/dashboard?job=NAME&token=T``: live frames from the DashboardHub (viewer role).
- ``GET /api/v1/whoami``: the caller's name and role, so the page shows operator controls.
- ``GET /api/v1/jobs/{job}/forecast?total_steps=N``: ETA and cost to finish.
"""

from __future__ import annotations

import importlib.util
import mimetypes
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Query, WebSocket
from fastapi.responses import FileResponse, Response

from backend.api.deps import ServicesDep, ViewerDep, websocket_actor
from backend.auth.tokens import role_allows
from backend.live.state import eta_seconds
from trainer_hook.protocol import CLOSE_FORBIDDEN, CLOSE_UNAUTHORIZED, MAX_BATCH_INDEX

__all__ = ["router", "FRONTEND_DIR", "plotly_js_path"]

FRONTEND_DIR = Path(__file__).resolve().parents[2] / "frontend"
_NO_CACHE = {"Cache-Control": "no-cache"}

router = APIRouter()


def plotly_js_path() -> Path:
    """Where the installed plotly package keeps plotly.min.js (RuntimeError if absent)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.origin:
        raise RuntimeError("The plotly package is not installed; pip install 'rebalancer[server]'.")
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise RuntimeError(f"plotly.min.js is missing from the plotly package (looked at {path}).")
    return path


def _page(name: str) -> FileResponse:
    path = FRONTEND_DIR / name
    if not path.is_file():
        raise HTTPException(404, f"Dashboard file {name} is missing from {FRONTEND_DIR}.")
    return FileResponse(path, media_type="text/html", headers=_NO_CACHE)


@router.get("/", include_in_schema=False)
def overview_page() -> FileResponse:
    return _page("index.html")


@router.get("/job/{job}", include_in_schema=False)
def job_page(job: str) -> FileResponse:
    return _page("job.html")


@router.get("/static/plotly.min.js", include_in_schema=False)
def plotly_js() -> FileResponse:
    try:
        path = plotly_js_path()
    except RuntimeError as exc:
        raise HTTPException(404, str(exc)) from None
    # The file changes only with the plotly package: let browsers keep it for a day.
    return FileResponse(path, media_type="text/javascript",
                        headers={"Cache-Control": "public, max-age=86400"})


@router.get("/static/{path:path}", include_in_schema=False)
def static_file(path: str) -> Response:
    root = FRONTEND_DIR.resolve()
    target = (root / path).resolve()
    if root not in target.parents or not target.is_file():
        raise HTTPException(404, f"No static file {path!r}.")
    media = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
    if target.suffix == ".js":
        media = "text/javascript"  # ES modules need a JavaScript type whatever the OS table says
    return FileResponse(target, media_type=media, headers=_NO_CACHE)


@router.websocket("/ws/dashboard")
async def dashboard_ws(websocket: WebSocket, job: str | None = None) -> None:
    """Live frames for the overview (no ``job``) or one job; needs the viewer role."""
    actor = websocket_actor(websocket)
    await websocket.accept()
    if actor is None:
        await websocket.close(CLOSE_UNAUTHORIZED, "Missing or invalid token; pass ?token=.")
        return
    if not role_allows(actor.role, "viewer"):
        await websocket.close(CLOSE_FORBIDDEN, "The dashboard needs the viewer role.")
        return
    services = websocket.app.state.services
    hub = services.hub
    if hub is None:
        await websocket.close(1011, "The dashboard hub is not running.")
        return
    services.sockets.add(actor, websocket)
    try:
        await hub.serve(websocket, job or None, actor)
    finally:
        services.sockets.discard(actor, websocket)


@router.get("/api/v1/whoami", tags=["auth"])
def whoami_route(actor: ViewerDep, services: ServicesDep) -> dict[str, Any]:
    """Who the bearer token belongs to; the page shows operator controls from ``role``."""
    return {
        "name": actor.name, "role": actor.role,
        "operator": role_allows(actor.role, "operator"),
        "open_mode": bool(services.auth.open_mode),
    }


@router.get("/api/v1/jobs/{job}/forecast", tags=["jobs"])
def forecast(
    job: str, actor: ViewerDep, services: ServicesDep,
    total_steps: int | None = Query(
        None, ge=1, le=MAX_BATCH_INDEX,
        description="Steps the run will take in all (default: what its hooks reported)."
    ),
) -> dict[str, Any]:
    """ETA and cost: the recent step time times the steps left; prices from settings."""
    view = services.live.view(job)
    if view is None:
        raise HTTPException(404, f"Job {job!r} not found.")
    if total_steps is None:
        total_steps = view.total_steps
    prices = [services.settings.price_for(r.device_type, r.device_name) for r in view.ranks]
    known = [p for p in prices if p is not None]
    cost_h = sum(known) if known else None
    done = (view.batch_index + 1) if view.batch_index is not None else 0
    remaining = max(total_steps - done, 0) if total_steps is not None else None
    eta = eta_seconds(total_steps, view.batch_index, view.step_ms)
    return {
        "job": job, "batch_index": view.batch_index, "total_steps": total_steps,
        "remaining_steps": remaining, "step_ms": view.step_ms, "eta_s": eta,
        "cost_per_hour": cost_h, "unpriced_ranks": len(prices) - len(known),
        "cost_to_finish": eta / 3600.0 * cost_h if eta is not None and cost_h is not None else None,
    }

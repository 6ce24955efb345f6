"""The dashboard's pages, static files, its websocket, and two small reads it needs.

- ``GET /``: jobs overview; ``GET /job/{job}``: job view (both plain HTML from frontend/).
- ``GET /static/plotly.min.js``: served from the installed ``plotly`` package (no CDN).
- ``GET /static/{path}``: the rest of frontend/ (ES modules, CSS): ``FrontendFiles``,
  mounted by ``create_app`` after this router (plotly's route comes first).
- ``WS /ws/dashboard?job=NAME&token=T``: live frames from the DashboardHub (viewer role).
- ``GET /api/v1/whoami``: the caller's name and role, so the page shows operator controls.
- ``GET /api/v1/jobs/{job}/forecast?total_steps=N``: ETA and cost to finish.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import mimetypes
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Query, WebSocket
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from backend.api.deps import PartsDep, ViewerDep, websocket_actor
from backend.auth.tokens import role_allows
from backend.live.forecast import forecast as job_forecast
from backend.parts import Parts
from trainer_hook.protocol import CLOSE_FORBIDDEN, CLOSE_UNAUTHORIZED

__all__ = ["router", "FRONTEND_DIR", "plotly_js_path", "FrontendFiles"]

# Package data: found the same way in a source tree and in a plain (non-editable) install.
FRONTEND_DIR = Path(str(importlib.resources.files("backend").joinpath("frontend")))
_NO_CACHE = {"Cache-Control": "no-cache"}

router = APIRouter()
mimetypes.add_type("text/javascript", ".js")  # ES modules need a JavaScript type whatever the OS table says


class FrontendFiles(StaticFiles):
    """``/static/*``: the dashboard's files (Starlette's StaticFiles: no path escapes the
    folder), never cached stale, and a missing file answered with one sentence."""

    def __init__(self) -> None:
        super().__init__(directory=FRONTEND_DIR)

    async def get_response(self, path: str, scope: Scope) -> Response:
        try:
            response = await super().get_response(path, scope)
        except StarletteHTTPException as exc:
            if exc.status_code == 404:
                raise StarletteHTTPException(404, f"No static file {path!r}.") from None
            raise
        response.headers.update(_NO_CACHE)
        return response


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


@router.websocket("/ws/dashboard")
async def dashboard_ws(websocket: WebSocket, job: str | None = None) -> None:
    """Live frames for the overview (no ``job``) or one job; needs the viewer role."""
    actor = await websocket_actor(websocket)
    await websocket.accept()
    if actor is None:
        await websocket.close(CLOSE_UNAUTHORIZED, "Missing or invalid token; pass ?token=.")
        return
    if not role_allows(actor.role, "viewer"):
        await websocket.close(CLOSE_FORBIDDEN, "The dashboard needs the viewer role.")
        return
    parts: Parts = websocket.app.state.parts
    parts.sockets.add(actor, websocket)
    try:
        await parts.hub.serve(websocket, job or None, actor)
    finally:
        parts.sockets.discard(actor, websocket)


@router.get("/api/v1/whoami", tags=["auth"])
def whoami_route(actor: ViewerDep, parts: PartsDep) -> dict[str, Any]:
    """Who the bearer token belongs to; the page shows operator controls from ``role``."""
    return {
        "name": actor.name, "role": actor.role,
        "operator": role_allows(actor.role, "operator"),
        "open_mode": bool(parts.auth.open_mode),
    }


@router.get("/api/v1/jobs/{job}/forecast", tags=["jobs"])
def forecast(
    job: str, actor: ViewerDep, parts: PartsDep,
    total_steps: int | None = Query(
        None, ge=1, description="Steps the run will take in all (default: what its hooks reported)."
    ),
) -> dict[str, Any]:
    """ETA and cost: the recent step time times the steps left; prices from settings
    (``backend.live.forecast``, the same figures the job resource and the dashboard show)."""
    view = parts.live.view(job)
    if view is None:
        raise HTTPException(404, f"Job {job!r} not found.")
    fc = job_forecast(view, parts.settings.price_for, total_steps)
    return {"job": job, **fc.as_dict()}

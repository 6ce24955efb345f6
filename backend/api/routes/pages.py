"""The dashboard's pages, static files and its websocket.

- ``GET /``: jobs overview; ``GET /job/{job}``: job view (both plain HTML from the top-level
  ``frontend`` package: each page's body set in ``_layout.html``, the head they share).
- ``GET /static/plotly.min.js``: served from the installed ``plotly`` package (no CDN).
- ``GET /static/{path}``: the rest of frontend/ (ES modules, CSS): ``FrontendFiles``,
  mounted by ``create_app`` after this router (plotly's route comes first).
- ``WS /ws/dashboard?job=NAME``: live frames from the DashboardHub (viewer role). The token
  comes as the first message, ``{"type": "auth", "token": T}`` (what the page sends: no
  secret in a URL), or as a bearer header; ``?token=T`` still works (its value is redacted
  from the logs).

The reads the pages make live with their resources: ``GET /api/v1/whoami`` in
``routes/identity.py``, ``GET /api/v1/jobs/{job}/forecast`` in ``routes/jobs.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.resources
import importlib.util
import json
import mimetypes
import string
from pathlib import Path

from fastapi import APIRouter, HTTPException, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from backend.api.deps import (
    authenticate,
    bearer_secret,
    websocket_actor,
)
from backend.api.edge import CSP, csp, sha256_source
from backend.assets import plotly_js_path
from backend.auth.access import allows
from backend.auth.tokens import Actor
from backend.parts import Parts
from rebalancer_wire.protocol import (
    CLOSE_FORBIDDEN,
    CLOSE_TOO_BIG,
    CLOSE_UNAUTHORIZED,
)

__all__ = ["router", "FRONTEND_DIR", "FrontendFiles", "AUTH_TIMEOUT_S", "AUTH_FRAME_MAX_BYTES",
           "report_csp"]

AUTH_TIMEOUT_S = 5.0  # a dashboard socket without a token in its URL sends it within this
AUTH_FRAME_MAX_BYTES = 4096

# Package data: found the same way in a source tree and in a plain (non-editable) install.
FRONTEND_DIR = Path(str(importlib.resources.files("frontend")))
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


@functools.cache
def report_csp() -> str:
    """The Content-Security-Policy of the job page and of the HTML report. The job page
    shows the report in a ``srcdoc`` frame, which lives under the page's policy: the
    report's own inline scripts (plotly.js, its chart runner) are allowed by hash, no other
    inline script. plotly.js styles what it draws with inline ``<style>`` rules, so these
    two pages (and only they) allow inline styles (CSS runs no code)."""
    from backend.report.html import inline_code  # it finds plotly.js through this module

    try:
        scripts, _styles = inline_code()
    except RuntimeError:  # plotly missing: the page says so, the report route fails anyway
        scripts = []
    return csp([sha256_source(x) for x in scripts], ["'unsafe-inline'"])


def _page(name: str, title: str, head: str = "", policy: str = CSP) -> HTMLResponse:
    """Page ``name`` (its body) set in ``_layout.html``, the head every page shares."""
    try:
        layout = (FRONTEND_DIR / "_layout.html").read_text(encoding="utf-8")
        body = (FRONTEND_DIR / name).read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise HTTPException(404, f"Dashboard file {Path(exc.filename).name} is missing from "
                                 f"{FRONTEND_DIR}.") from None
    html = string.Template(layout).substitute(title=title, head=head, body=body)
    return HTMLResponse(html, headers={**_NO_CACHE, "Content-Security-Policy": policy})


@router.get("/", include_in_schema=False)
def overview_page() -> HTMLResponse:
    return _page("index.html", "fleet")


@router.get("/job/{job}", include_in_schema=False)
def job_page(job: str) -> HTMLResponse:
    return _page("job.html", "job", '  <script src="/static/plotly.min.js"></script>\n', report_csp())


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
    if actor is None and bearer_secret(websocket.headers, websocket.query_params) is None:
        try:
            actor = await _first_message_actor(websocket)
        except _Refused as refused:
            await _close(websocket, refused.code, str(refused))
            return
        except WebSocketDisconnect:
            return  # the client left before it sent a token: nothing to answer
    if actor is None:
        await _close(websocket, CLOSE_UNAUTHORIZED,
                     "Missing or invalid token; send {\"type\": \"auth\", \"token\": T} first.")
        return
    if not allows(actor, "viewer"):
        await _close(websocket, CLOSE_FORBIDDEN, "The dashboard needs the viewer role.")
        return
    parts: Parts = websocket.app.state.parts
    parts.sockets.add(actor, websocket)
    try:
        await parts.hub.serve(websocket, job or None, actor)
    finally:
        parts.sockets.discard(actor, websocket)


class _Refused(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


AUTH_FRAME_TOO_LARGE = (f"The first frame must be the auth message, at most {AUTH_FRAME_MAX_BYTES} bytes; "
                        "send {\"type\": \"auth\", \"token\": T}.")


async def _close(websocket: WebSocket, code: int, reason: str) -> None:
    """Close with a reason; a client that already left is not an error (nothing to log)."""
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):
        await websocket.close(code, reason)


async def _first_message_actor(websocket: WebSocket) -> Actor | None:
    """The actor of ``{"type": "auth", "token": T}``, the first frame of a browser's socket
    (so the secret is in no URL, hence in no access log); None when anything else comes, or
    nothing within ``AUTH_TIMEOUT_S``; ``_Refused`` (1009) for a frame over
    ``AUTH_FRAME_MAX_BYTES``; ``WebSocketDisconnect`` when the client left."""
    try:
        frame = await asyncio.wait_for(websocket.receive(), AUTH_TIMEOUT_S)
    except TimeoutError:
        return None
    if frame["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(frame.get("code", 1000))
    raw = frame.get("text")
    if raw is None:
        raw = frame.get("bytes") or b""
    if len(raw) > AUTH_FRAME_MAX_BYTES:
        raise _Refused(CLOSE_TOO_BIG, AUTH_FRAME_TOO_LARGE)
    if not isinstance(raw, str):
        return None
    try:
        msg = json.loads(raw)
    except ValueError:
        return None
    token = msg.get("token") if isinstance(msg, dict) and msg.get("type") == "auth" else None
    if not isinstance(token, str) or not token:
        return None
    parts: Parts = websocket.app.state.parts
    address = websocket.client.host if websocket.client else None
    return await authenticate(parts, token, address)

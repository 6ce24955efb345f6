"""``/docs`` (Swagger UI) with its script and styles served from the installed
``fastapi-offline`` package, so the API docs work with no internet. FastAPI's own
``/docs`` and ``/redoc`` load from a CDN; ``create_app`` turns them off (ReDoc is not
served: its page fetches a logo from the internet whatever it is given)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse

from backend.api.edge import csp, sha256_source

__all__ = ["router", "docs_assets_dir", "ASSETS"]

router = APIRouter(include_in_schema=False)
ASSETS = {  # URL name -> media type
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon.png": "image/png",
}
_PREFIX = "/docs-assets"
_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.S)


def docs_assets_dir() -> Path:
    """Where fastapi-offline keeps Swagger UI (RuntimeError if it is missing)."""
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or not spec.origin:
        raise RuntimeError("The fastapi-offline package is not installed; pip install 'torch-rebalancer[server]'.")
    return Path(spec.origin).parent / "static"


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    app = request.app
    page = get_swagger_ui_html(
        openapi_url=app.openapi_url, title=f"{app.title} - API docs",
        oauth2_redirect_url="/docs/oauth2-redirect",
        swagger_js_url=f"{_PREFIX}/swagger-ui-bundle.js", swagger_css_url=f"{_PREFIX}/swagger-ui.css",
        swagger_favicon_url=f"{_PREFIX}/favicon.png",
    )
    return _allow_own_inline(page)


def _allow_own_inline(page: HTMLResponse) -> HTMLResponse:
    """FastAPI's Swagger UI pages start Swagger with an inline script: allow exactly it."""
    scripts = _INLINE_SCRIPT.findall(bytes(page.body).decode())
    page.headers["Content-Security-Policy"] = csp([sha256_source(x) for x in scripts])
    return page


@router.get("/docs/oauth2-redirect")
def swagger_ui_redirect() -> HTMLResponse:
    return _allow_own_inline(get_swagger_ui_oauth2_redirect_html())


@router.get(_PREFIX + "/{name}")
def docs_asset(name: str) -> FileResponse:
    media = ASSETS.get(name)
    if media is None:
        raise HTTPException(404, f"No docs asset {name!r}.")
    try:
        path = docs_assets_dir() / name
    except RuntimeError as exc:
        raise HTTPException(404, str(exc)) from None
    if not path.is_file():
        raise HTTPException(404, f"{name} is missing from {path.parent}.")
    # The files change only with the package: let browsers keep them for a day.
    return FileResponse(path, media_type=media, headers={"Cache-Control": "public, max-age=86400"})

"""``/docs`` in headless Chromium with the network cut off: every request
goes to the backend itself and succeeds, and the pages render the API."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from tests.browser._chromium import ARGS, CHROMIUM, playwright_sync_api
from tests.helpers.server import running_server

pytestmark = [pytest.mark.browser]


sync_api = playwright_sync_api()


def _open(browser: Any, url: str, ready: str) -> list[str]:
    """Load ``url`` with every non-loopback request aborted; return what went wrong."""
    problems: list[str] = []
    ctx = browser.new_context()
    page = ctx.new_page()

    def route(r: Any) -> None:
        host = urllib.parse.urlsplit(r.request.url).hostname
        if host not in ("127.0.0.1", "localhost") and not r.request.url.startswith("data:"):
            problems.append(f"outside request {r.request.url}")
            r.abort()
        else:
            r.continue_()

    page.route("**/*", route)
    page.on("requestfailed", lambda req: problems.append(f"failed {req.url}: {req.failure}"))
    page.on("response", lambda resp: resp.status >= 400 and problems.append(f"{resp.status} {resp.url}"))
    page.on("pageerror", lambda exc: problems.append(f"page error {exc}"))
    page.goto(url)
    page.wait_for_selector(ready, timeout=30_000)
    ctx.close()
    return problems


def test_api_docs_load_with_no_internet(tmp_path: Path):
    with running_server(tmp_path) as server, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            # Swagger UI renders the operations (e.g. GET /api/v1/jobs) from /openapi.json.
            assert _open(browser, server.url + "/docs", "#operations-jobs-list_jobs_api_v1_jobs_get") == []
            assert server.call("GET", "/docs-assets/nope.js") == (404, {"detail": "No docs asset 'nope.js'."})
            assert server.call("GET", "/redoc")[0] == 404  # FastAPI's CDN-loaded ReDoc is off
        finally:
            browser.close()

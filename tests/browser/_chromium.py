"""The one headless Chromium of the browser tests: Debian's binary driven by Playwright.

``playwright_sync_api()`` at a test module's import skips the module (fails it under
REBALANCER_REQUIRE_ALL=1, as CI sets) when Chromium or Playwright is missing;
``chromium()`` opens the browser for a block and ``new_page`` a page of it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from tests.helpers.require import unavailable

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def playwright_sync_api() -> ModuleType:
    if not os.path.exists(CHROMIUM):
        unavailable(f"{CHROMIUM} is missing; install Debian's chromium (make browser).", module=True)
    try:
        return importlib.import_module("playwright.sync_api")
    except ImportError:
        unavailable("playwright is not installed (make setup installs it).", module=True)
        raise


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium (Playwright's ``Browser``) for the block, closed after it."""
    with playwright_sync_api().sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


def new_page(browser: Any, *, timeout_ms: int = 60_000, viewport: dict[str, int] | None = None) -> Any:
    """A page of ``browser`` (``viewport``: in a context of that size) whose waits give up
    after ``timeout_ms``."""
    page = (browser.new_context(viewport=viewport) if viewport else browser).new_page()
    page.set_default_timeout(timeout_ms)
    return page

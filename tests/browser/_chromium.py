"""The one headless Chromium of the browser tests: Debian's binary driven by Playwright.

``playwright_sync_api()`` at a test module's import skips the module (fails it under
REBALANCER_REQUIRE_ALL=1, as CI sets) when Chromium or Playwright is missing.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

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

"""Missing services: skip locally, fail in CI.

``REBALANCER_REQUIRE_ALL=1`` (``.ci/run`` exports it) turns the skip of a test whose
PostgreSQL server or Chromium is missing into a failure, so CI cannot pass by skipping.
"""

from __future__ import annotations

import os

import pytest

__all__ = ["require_all", "unavailable"]


def require_all() -> bool:
    """True where a missing PostgreSQL or Chromium must fail the run, not skip (CI)."""
    return os.environ.get("REBALANCER_REQUIRE_ALL") == "1"


def unavailable(what: str, *, module: bool = False) -> None:
    """Skip (``module``: the whole module), or fail under REBALANCER_REQUIRE_ALL=1."""
    if require_all():
        pytest.fail(f"{what} (REBALANCER_REQUIRE_ALL=1: nothing may be skipped)", pytrace=False)
    pytest.skip(what, allow_module_level=module)

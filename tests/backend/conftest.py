"""Fixtures the backend's tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.postgres import pg_schema


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database of each kind the backend stores to: a SQLite file, then a schema of
    its own on the local PostgreSQL (tests/helpers/postgres.py)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'rebalancer.db'}"
        return
    with pg_schema() as url:
        yield url

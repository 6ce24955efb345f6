"""The local PostgreSQL server (127.0.0.1:5432, trust auth, db ``test``) for storage tests.

Each test gets a schema of its own (``pg_schema``), dropped afterwards: the database is
shared by every test run on the machine, so nothing may depend on or change ``public``.
Without a server the test skips, or fails when ``REBALANCER_REQUIRE_ALL=1`` (CI).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from tests.helpers.require import unavailable

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@contextlib.contextmanager
def pg_schema() -> Iterator[str]:
    """A URL whose connections use a fresh schema; the schema is dropped on exit."""
    admin = create_engine(PG_URL)
    name = f"t_{uuid.uuid4().hex[:12]}"
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{name}"'))
    except OperationalError as exc:
        admin.dispose()
        unavailable(f"PostgreSQL at {PG_URL} is unreachable: {exc.orig}")
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{name}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{name}" CASCADE'))
        admin.dispose()

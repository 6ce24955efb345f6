"""Schema migrations (Alembic), applied by ``rebalancer serve`` at start and by
``rebalancer db upgrade``. ``upgrade(engine)`` brings any database to the newest schema:
a new one is created by the migrations, one made by ``create_all`` before migrations
existed (no ``alembic_version`` table, same tables as 0001) is stamped 0001 first.

Revisions live in ``versions/`` and never import the models: each states its own tables.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect

__all__ = ["upgrade", "create_head", "current", "HEAD", "FIRST"]

HEAD = "0007"
FIRST = "0001"


def _config(connection: object) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).resolve().parent))
    cfg.attributes["connection"] = connection
    return cfg


def current(engine: Engine) -> str | None:
    """The revision the database is at (None: never migrated)."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def create_head(engine: Engine) -> None:
    """The newest schema straight from the models, stamped head: what the migrations build
    (a test compares the two), in one transaction instead of every step's DDL."""
    from backend.storage.base import Base
    from backend.storage.models import load_models

    load_models()
    with engine.begin() as conn:
        Base.metadata.create_all(conn)
        command.stamp(_config(conn), HEAD)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the database to ``revision`` (idempotent). An empty database gets the newest
    schema at once (``create_head``); one already at head costs one query."""
    with engine.connect() as conn:
        tables = set(inspect(conn).get_table_names())
        at = MigrationContext.configure(conn).get_current_revision() if "alembic_version" in tables else None
    if revision == "head":
        if not tables:
            create_head(engine)
            return
        if at == HEAD:
            return
    with engine.begin() as conn:
        cfg = _config(conn)
        if at is None and "jobs" in tables:
            command.stamp(cfg, FIRST)  # made by create_all before this release's migrations
        command.upgrade(cfg, revision)

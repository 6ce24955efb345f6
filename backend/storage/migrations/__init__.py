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

__all__ = ["upgrade", "current", "HEAD", "FIRST"]

HEAD = "0003"
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


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply every migration up to ``revision`` (idempotent)."""
    with engine.begin() as conn:
        tables = set(inspect(conn).get_table_names())
        cfg = _config(conn)
        if "alembic_version" not in tables and "jobs" in tables:
            command.stamp(cfg, FIRST)  # made by create_all before this release's migrations
        command.upgrade(cfg, revision)

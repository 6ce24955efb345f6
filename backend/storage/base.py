"""SQLAlchemy declarative base and engine construction shared by every table module."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, Float, create_engine, event
from sqlalchemy.orm import DeclarativeBase, sessionmaker

__all__ = ["Base", "make_engine", "make_sessionmaker"]


class Base(DeclarativeBase):
    # A column annotated ``Mapped[float]`` (or ``int``) needs no ``mapped_column``: its type
    # comes from here (FLOAT, as the migrations create it; SQLAlchemy's default is DOUBLE)
    # and its nullability from ``| None``.
    type_annotation_map = {float: Float}


def make_engine(url: str) -> Engine:
    """An engine for a SQLite file (parent folder created, rollback journal) or a PostgreSQL URL.

    SQLite runs with its rollback journal (``journal_mode=DELETE``), not WAL: WAL keeps its
    index in a memory-mapped ``-shm`` file, and a write to a mapped page of a file that
    became unwritable (``chattr +i``, a file system gone read-only) kills the process with
    SIGBUS instead of failing the statement. The rollback journal maps nothing, so every
    storage fault is an error the backend can report and wait out (docs/reliability.md).
    The backend runs all its SQL on one thread, so WAL's readers-beside-a-writer buys it
    nothing; other processes (the CLI, ``rebalancer report``) wait up to 5 s for a lock.
    A database made in WAL mode by an earlier version is switched back on first open.

    ``postgresql://`` is rewritten to the psycopg 3 driver, the one the project installs.
    """
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    if url.startswith("sqlite:///") and not url.startswith("sqlite:///:memory:"):
        Path(url[len("sqlite:///"):]).expanduser().parent.mkdir(parents=True, exist_ok=True)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=DELETE")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


def make_sessionmaker(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)

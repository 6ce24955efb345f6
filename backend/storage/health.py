"""StorageHealth: the one answer to "does the database take writes now?", for ``/healthz``,
the persist loop and the log.

``check()`` (SQL thread) finds, in order: for SQLite, whether the file at the configured
path is still the one the backend opened (same device and inode); then whether it may write (for
SQLite the file, its folder and any journal beside it are writable; then a statement that updates no row, rolled
back). A SQLite file deleted
while serving is restored from the backend's own open connection (which still sees every
committed row): ``VACUUM INTO`` a file beside it from an idle pooled connection, close the old connections, move the copy
into place. A file replaced by another one is reported and used from then on. When a problem clears, the connection pool is recycled: a SQLite connection
opened while the file was read-only stays read-only until closed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

from backend.storage.writes import database_fault, one_line

__all__ = ["StorageHealth", "sqlite_path", "report_fault", "log_failure"]

log = logging.getLogger("rebalancer.storage")

_reported: dict[str, tuple[float, int]] = {}  # what -> (last logged, suppressed since)
_reported_lock = threading.Lock()


def report_fault(logger: logging.Logger, what: str, exc: BaseException, *,
                 interval_s: float = 60.0) -> None:
    """Log ``what failed: reason`` at most once per ``interval_s`` per ``what``, with how many
    were left out; no traceback (a database outage is not a bug, and it repeats per frame)."""
    now = time.monotonic()
    with _reported_lock:
        last, quiet = _reported.get(what, (-float("inf"), 0))
        if now - last < interval_s:
            _reported[what] = (last, quiet + 1)
            return
        _reported[what] = (now, 0)
    more = f" ({quiet} more like it since the last report)" if quiet else ""
    logger.warning("%s failed: %s%s", what, one_line(exc), more)


def log_failure(logger: logging.Logger, what: str, exc: BaseException) -> None:
    """A database fault rate-limited and without traceback (``report_fault``); anything else
    is a bug and logged with its traceback."""
    if database_fault(exc):
        report_fault(logger, what, exc)
    else:
        logger.error("%s failed", what, exc_info=exc)


def sqlite_path(engine: Engine) -> Path | None:
    """The file of a SQLite engine; None for PostgreSQL and in-memory SQLite."""
    if engine.url.get_backend_name() != "sqlite":
        return None
    db = engine.url.database
    if not db or db == ":memory:" or db.startswith("file:"):
        return None
    return Path(db).expanduser().resolve()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _side_files(path: Path) -> list[Path]:
    """The SQLite files beside the database that exist now (journal, WAL, WAL index)."""
    return [p for p in (path.with_name(path.name + s) for s in ("-journal", "-wal", "-shm")) if p.exists()]


class StorageHealth:
    """Database health. ``problem`` is None while it takes writes, else one sentence."""

    def __init__(self, engine: Engine, *, probe_table: str,
                 clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.probe_table = probe_table
        self._clock = clock
        self.path = sqlite_path(engine)
        self._opened = _identity(self.path) if self.path else None
        self._lock = threading.Lock()
        self.problem: str | None = None
        self.since: float | None = None
        self.restored_total = 0

    def check(self) -> str | None:
        """Probe now; returns and records the problem (None when writable). SQL thread."""
        with self._lock:
            if self.problem is not None:
                self.engine.dispose()  # a connection opened during the fault keeps it: reopen
            problem = self._file_problem() or self._write_problem()
            self._record(problem)
            return problem

    def _record(self, problem: str | None) -> None:
        if problem is not None and self.problem is None:
            self.since = self._clock()
            log.warning("database degraded: %s", problem)
            self.engine.dispose()  # every connection sees the fault alike, none half-writes
        elif problem is None and self.problem is not None:
            log.warning("database ok again after %.0f s (was: %s)",
                        self._clock() - (self.since or self._clock()), self.problem)
            self.since = None
            self.engine.dispose()  # connections opened during the fault may stay read-only
        self.problem = problem

    def _file_problem(self) -> str | None:
        if self.path is None or self._opened is None:
            return None
        now = _identity(self.path)
        if now == self._opened:
            return None
        if now is None:
            return self._restore()
        self.engine.dispose()
        self._opened = now
        return (f"the database file {self.path} was replaced while the backend was serving; "
                f"the backend uses the new file from now on")

    def _restore(self) -> str:
        deleted = f"the database file {self.path} was deleted while the backend was serving"
        assert self.path is not None
        # An idle pooled connection still has the deleted file open (a new one would create
        # an empty file at the path instead).
        if self.engine.pool.checkedin() == 0:  # type: ignore[attr-defined]
            return f"{deleted}; no open connection is left to restore it from: restart the backend"
        tmp = self.path.with_name(self.path.name + ".restoring")
        try:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            with self.engine.connect() as c:
                c.exec_driver_sql("VACUUM INTO ?", (str(tmp),))
            # Close the old connections before the copy takes the path (one that closed
            # later could still act on side files by name).
            self.engine.dispose()
            os.replace(tmp, self.path)
        except (SQLAlchemyError, sqlite3.Error, OSError) as exc:
            return f"{deleted}; restoring it failed ({one_line(exc)})"
        self._opened = _identity(self.path)
        self.restored_total += 1
        log.warning("%s; restored it from the backend's open connection", deleted)
        return f"{deleted}; restored it from the backend's open connection"

    def _write_problem(self) -> str | None:
        if self.path is not None:
            # Asked of the file system, not of a new SQLite connection: in one process SQLite
            # hands a new connection a descriptor an old one opened (POSIX locks are per
            # process), which keeps its write access; opening the file ourselves would drop
            # SQLite's locks when closed.
            # Every file SQLite writes: the database, its folder (the journal is made and
            # removed there) and a side file that exists (a journal left by a crash, the -wal
            # and -shm of a database an earlier version ran in WAL mode).
            for p in (self.path, self.path.parent, *_side_files(self.path)):
                if not os.access(p, os.W_OK):
                    return f"the database does not take writes: {p} is read-only"
        try:
            with self.engine.connect() as c:
                c.execute(text(f"UPDATE {self.probe_table} SET id = id WHERE 1 = 0"))
                c.rollback()
        except Exception as exc:  # report, never raise: the probe must always answer
            return f"the database does not take writes: {one_line(exc)}"
        return None

    def close(self) -> None:
        """Nothing to release today; kept so owners stop it like their other parts."""

"""WriteBuffer: metric windows on their way to SQL, isolated per job, retried while the
database is away, and counted when finally dropped.

The event loop owns the buffer (``add``); ``write(session_factory)`` runs on the SQL thread
and takes what is pending. Each job's windows go in a transaction of their own, so one job's
bad row never costs another job its rows. A row the database refuses (out of range, a value
it cannot store) is found by writing that job's rows one by one and is dropped alone. When
the database itself fails (read-only, gone, locked, unreachable) nothing is dropped: the
rows wait in the buffer and the next flush tries again, oldest first. The buffer holds at
most ``max_windows``; past that the oldest are dropped. Drops are counted (``dropped_total``,
exported as ``rebalancer_persist_dropped_windows_total``) and logged at most once per
``log_interval_s``, never per row.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.orm import Session

__all__ = ["WriteBuffer", "WriteOutcome", "database_fault", "one_line"]

log = logging.getLogger("rebalancer.storage")


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` of an exception on one line (the driver's own message when wrapped)."""
    inner = getattr(exc, "orig", None) or exc
    text = " ".join(str(inner).split()) or repr(inner)
    return f"{type(inner).__name__}: {text}"[:limit]


def database_fault(exc: BaseException) -> bool:
    """True when the database failed (read-only, unreachable, locked, schema gone); False when
    the statement's data did (a value out of range, a constraint, a value the driver cannot
    bind): those rows are refused, the database is fine."""
    if isinstance(exc, (DataError, IntegrityError)):
        return False
    return isinstance(exc, DBAPIError)


@dataclass
class WriteOutcome:
    """What one ``write`` did."""

    written: int = 0
    refused: int = 0  # rows the database refused (dropped)
    kept: int = 0  # rows left in the buffer for the next try (database fault)
    fault: str | None = None  # the database's error when it failed


@dataclass
class _Drops:
    refused: int = 0
    overflow: int = 0
    examples: dict[str, str] = field(default_factory=dict)  # job -> one refusal


class WriteBuffer:
    """Rows waiting for SQL. ``write_rows(session, rows)`` stores rows (caller's statement,
    no commit); ``job_of(row)`` names the job a row belongs to."""

    def __init__(self, *, write_rows: Callable[[Session, Sequence[Any]], int],
                 job_of: Callable[[Any], str], max_windows: int = 100_000,
                 log_interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        if max_windows < 1:
            raise ValueError(f"max_windows must be at least 1, got {max_windows}.")
        self._write_rows = write_rows
        self._job_of = job_of
        self.max_windows = max_windows
        self.log_interval_s = log_interval_s
        self._clock = clock
        self._lock = threading.Lock()  # add() on the loop, write() on the SQL thread
        self._pending: deque[Any] = deque()
        self.written_total = 0
        self.dropped_total = 0  # refused + overflow, since start
        self.fault: str | None = None  # the database's error while writes fail, else None
        self.fault_since: float | None = None
        self._drops = _Drops()
        self._last_log = -float("inf")
        self._fault_logged: str | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def add(self, rows: Iterable[Any]) -> None:
        """Queue rows; past ``max_windows`` the oldest are dropped (and counted)."""
        with self._lock:
            self._pending.extend(rows)
            over = len(self._pending) - self.max_windows
            for _ in range(max(over, 0)):
                self._pending.popleft()
            if over > 0:
                self.dropped_total += over
                self._drops.overflow += over

    def _take(self) -> list[Any]:
        with self._lock:
            rows = list(self._pending)
            self._pending.clear()
            return rows

    def _put_back(self, rows: list[Any]) -> None:
        # Back in front of anything added meanwhile, so history stays in order; then the bound.
        with self._lock:
            self._pending.extendleft(reversed(rows))
        self.add(())

    def write(self, sessions: Callable[[], Session]) -> WriteOutcome:
        """Write what is pending, one transaction per job (SQL thread)."""
        out = WriteOutcome()
        rows = self._take()
        by_job: dict[str, list[Any]] = {}
        for row in rows:
            by_job.setdefault(self._job_of(row), []).append(row)
        jobs = list(by_job)
        for i, job in enumerate(jobs):
            fault, unwritten = self._write_job(sessions, job, by_job[job], out)
            if fault is not None:  # the database is away: keep this job's rest and the others'
                rest = unwritten + [r for j in jobs[i + 1:] for r in by_job[j]]
                out.kept, out.fault = len(rest), fault
                self._put_back(rest)
                break
        self.written_total += out.written
        self._note(out)
        return out

    def _write_job(self, sessions: Callable[[], Session], job: str, rows: list[Any],
                   out: WriteOutcome) -> tuple[str | None, list[Any]]:
        """Returns the database's fault (None when it answered) and the rows not written."""
        try:
            with sessions() as s:
                n = self._write_rows(s, rows)
                s.commit()
            out.written += n
            return None, []
        except Exception as exc:
            if database_fault(exc):
                return one_line(exc), rows
        # One of this job's rows is refused: find it by writing the rows one by one.
        for i, row in enumerate(rows):
            try:
                with sessions() as s:
                    out.written += self._write_rows(s, [row])
                    s.commit()
            except Exception as exc:
                if database_fault(exc):
                    return one_line(exc), rows[i:]
                out.refused += 1
                with self._lock:
                    self.dropped_total += 1
                    self._drops.refused += 1
                    self._drops.examples.setdefault(job, one_line(exc))
        return None, []

    def _note(self, out: WriteOutcome) -> None:
        """Log at most once per interval: drops since the last line, a fault, a recovery."""
        now = self._clock()
        if out.fault is not None:
            if self.fault is None:
                self.fault_since = now
            self.fault = out.fault
        elif out.written and self.fault is not None:
            log.warning("the database takes writes again after %.0f s (%s); %d buffered windows written",
                        now - (self.fault_since or now), self.fault, out.written)
            self.fault, self.fault_since, self._fault_logged = None, None, None
        if now - self._last_log < self.log_interval_s and not (
                self.fault is not None and self._fault_logged is None):
            return
        with self._lock:
            drops, self._drops = self._drops, _Drops()
            waiting = len(self._pending)
        said = False
        if self.fault is not None:
            log.warning("persisting metrics failed: %s; %d windows wait in memory (at most %d), "
                        "retrying each interval", self.fault, waiting, self.max_windows)
            self._fault_logged = self.fault
            said = True
        if drops.refused:
            shown = "; ".join(f"job '{j}': {e}" for j, e in sorted(drops.examples.items())[:3])
            log.warning("dropped %d metric windows the database refused (%s); other jobs' rows "
                        "were written", drops.refused, shown)
            said = True
        if drops.overflow:
            log.warning("dropped the %d oldest metric windows: the write buffer holds at most %d "
                        "while the database is away", drops.overflow, self.max_windows)
            said = True
        if said:
            self._last_log = now

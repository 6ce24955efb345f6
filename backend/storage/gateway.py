"""SqlGateway: the one thread that runs the backend's SQL for its async code.

The event loop owns live and control state; every SQL statement that async code needs goes
through ``await gateway.run(fn)``, where ``fn(session)`` runs on the gateway's single worker
thread with a fresh session. One thread means calls run in the order they were made, never
two at once (SQLite's single writer is never contended from inside the backend), and the
loop never blocks on the database. Synchronous callers (the CLI, start-up) use
``gateway.call(fn)``, which runs ``fn`` on the calling thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from sqlalchemy.orm import Session, sessionmaker

__all__ = ["SqlGateway"]

T = TypeVar("T")


class SqlGateway:
    """Runs ``fn(session)`` on one worker thread (``run``) or in place (``call``)."""

    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rebalancer-sql")
        self.calls = 0

    def _in_session(self, fn: Callable[[Session], T]) -> T:
        self.calls += 1
        with self.sessions() as s:
            return fn(s)

    async def run(self, fn: Callable[[Session], T]) -> T:
        """``fn(session)`` on the gateway thread; the caller commits inside ``fn``."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._in_session, fn)

    def call(self, fn: Callable[[Session], T]) -> T:
        """``fn(session)`` right here, for code that is not on the event loop."""
        return self._in_session(fn)

    def close(self) -> None:
        """Wait for queued calls, then stop the thread."""
        self._pool.shutdown(wait=True)

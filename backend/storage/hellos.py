"""HelloWriter: the hellos' rows, stored by the batch (group commit); the event loop owns its queue.

Every rank says hello when it connects, and a job's ranks connect together: 16,384 ranks
stored one transaction each, behind the metric windows on the one SQL thread, took minutes
(about 14 hellos a second at PostgreSQL under load, docs/scale-out.md). Here a hello waits
for the batch that is being written, if any, and goes into the next one with every hello
that arrived meanwhile: one transaction (``upsert_hellos``: a statement per table, not per
rank) per batch, so the rate grows with the load instead of queueing behind it. A lone hello
is written at once (no timer, no added latency).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from backend.storage.gateway import SqlGateway
from backend.storage.metrics import upsert_hellos
from rebalancer_wire.protocol import Hello

__all__ = ["HelloWriter", "MAX_HELLO_BATCH"]

log = logging.getLogger("rebalancer.storage")

# Hellos in one transaction at most (a 100,000-rank job's start is a few of them).
MAX_HELLO_BATCH = 4096


def _store(hellos: Sequence[Hello]) -> Callable[[Session], None]:
    def work(s: Session) -> None:
        # One retry covers a second backend process creating the same job or rank rows.
        for attempt in (1, 2):
            try:
                upsert_hellos(s, hellos)
                s.commit()
                return
            except IntegrityError:
                s.rollback()
                if attempt == 2:
                    raise
    return work


class HelloWriter:
    """``await writer.store(hello)`` returns once the hello's job and rank rows are committed
    (or raises what the batch's transaction raised)."""

    def __init__(self, sql: SqlGateway, *, max_batch: int = MAX_HELLO_BATCH):
        self.sql = sql
        self.max_batch = max_batch
        self._queue: list[tuple[Hello, asyncio.Future[None]]] = []
        self._writing: asyncio.Task[None] | None = None
        self.batches = 0  # transactions written (tests, and /metrics-free diagnostics)
        self.stored = 0  # hellos in them

    async def store(self, hello: Hello) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((hello, fut))
        if self._writing is None or self._writing.done():
            self._writing = asyncio.create_task(self._drain())
        await asyncio.shield(fut)  # a caller that goes away leaves its hello in the batch

    async def _drain(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
            try:
                await self.sql.run(_store([h for h, _ in batch]))
            except Exception as exc:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                        fut.exception()  # the waiters raise it; a gone waiter must not warn
                continue
            self.batches += 1
            self.stored += len(batch)
            for _, fut in batch:
                if not fut.done():
                    fut.set_result(None)

"""How a cluster part's background loop waits and ends (``JobLeases``, ``LiveFanout``).

A loop ends on its ``stopping`` event, not on cancellation alone: redis-py 8.2 swallows a
CancelledError that lands while a command is on the wire (the await returns the reply, the
task stays 'cancelling'), and the loop would go on after ``stop()``."""

from __future__ import annotations

import asyncio
import contextlib

from backend.tasks import cancel_and_wait

__all__ = ["pause", "end"]


async def pause(stopping: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds``, or less when ``stopping`` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)


async def end(stopping: asyncio.Event, task: asyncio.Task[None] | None) -> None:
    """Set ``stopping``, cancel ``task`` and wait until it is done."""
    stopping.set()
    await cancel_and_wait(task)

"""Poll until a condition holds: every wait ends early on success; a timeout says what it was for."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def wait_until(pred: Callable[[], Any], what: str, timeout: float = 30.0, *, interval: float = 0.1,
               log: Callable[[], str] | None = None) -> Any:
    """Return ``pred()``'s first truthy value; raise AssertionError (with ``log()``'s tail) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(interval)
    tail = f"\n{log()[-3000:]}" if log is not None else ""
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{tail}")


async def wait_until_async(pred: Callable[[], Any], what: str = "the condition", timeout: float = 30.0, *,
                           interval: float = 0.005) -> Any:
    """``wait_until`` for code on an event loop: sleeps with ``asyncio.sleep``."""
    import asyncio

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def wait_gone(pid: int, what: str, timeout: float = 30.0, *, log: Callable[[], str] | None = None) -> None:
    """Wait until process ``pid`` has exited (gone, or a zombie its dead parent left)."""
    import psutil

    def gone() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(gone, what, timeout, log=log)


class Collect(list):  # type: ignore[type-arg]
    """A callback that keeps every item it is called with; ``enough`` is set once it holds ``n``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.enough = threading.Event()

    def __call__(self, item: Any) -> None:
        self.append(item)
        if len(self) >= self.n:
            self.enough.set()

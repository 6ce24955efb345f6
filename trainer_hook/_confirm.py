"""``Unconfirmed``: the metrics frames a transport sent on its connection that no pong has
confirmed yet (the sender thread owns it).

A backend answers a ping only after reading every frame sent before it, so a pong confirms
them. A connection that breaks without a close frame, or a backend silent for
``silent_s`` (a paused process: its socket takes our frames, nothing reads them), gives its
unconfirmed frames back to be sent on the next connection: a failover then loses at most
what the old backend read and had not stored (its persist interval).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Silent", "Unconfirmed"]

MAX_UNCONFIRMED = 1024  # beyond it the oldest is given up on (the backend most likely read it)
CONFIRM_EVERY_S = 0.5  # at most one confirming ping this often, and only with frames to confirm


class Silent(Exception):
    """The backend answered no ping for ``silent_s`` (paused, or its host is gone)."""


class Unconfirmed:
    def __init__(self, silent_s: float):
        self.silent_s = silent_s
        self.frames: list[str] = []
        self._ping: tuple[threading.Event, int, float] | None = None  # (pong, frames covered, sent at)
        self._next_ping = 0.0

    def reset(self) -> None:
        self.frames, self._ping = [], None

    def take(self) -> list[str]:
        frames = self.frames
        self.reset()
        return frames

    def sent(self, frame: str) -> None:
        if len(self.frames) >= MAX_UNCONFIRMED:
            self.frames.pop(0)
            if self._ping is not None and self._ping[1] > 0:
                self._ping = (self._ping[0], self._ping[1] - 1, self._ping[2])
        self.frames.append(frame)

    def check(self, ping: Callable[[], threading.Event], url: str) -> None:
        """Drop what a pong confirmed; ping for the rest (one ping in flight at most). Raise
        ``Silent`` when the backend at ``url`` answered no ping for ``silent_s``."""
        now = time.monotonic()
        if self._ping is not None:
            pong, covered, sent_at = self._ping
            if pong.is_set():
                del self.frames[:covered]
                self._ping = None
            elif now - sent_at > self.silent_s:
                raise Silent(f"The backend at {url} answered no ping for {self.silent_s:g} s "
                             f"({len(self.frames)} metrics frames unconfirmed)")
            else:
                return
        if self.frames and now >= self._next_ping:
            self._ping = (ping(), len(self.frames), now)
            self._next_ping = now + CONFIRM_EVERY_S

"""Per-connection budgets: token buckets of frames and bytes a websocket peer may send.

One ``FrameBudget`` per connection, touched only by that connection's handler. ``take``
charges one frame; it returns None while within budget, else the one sentence the
connection is closed with. Hooks get ``HOOK_FRAMES_*`` and ``HOOK_BYTES_*`` (the backend's
to set: the wire format only bounds a frame's size); dashboards, which only listen, a much
smaller one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rebalancer_wire.protocol import MAX_MESSAGE_BYTES

__all__ = ["FrameBudget", "DASHBOARD_FRAMES_PER_S", "DASHBOARD_FRAMES_BURST", "DASHBOARD_MAX_FRAME_BYTES",
           "HOOK_FRAMES_PER_S", "HOOK_FRAMES_BURST", "HOOK_BYTES_PER_S", "HOOK_BYTES_BURST",
           "HOOK_HELLO_FRAMES"]

# Per-connection budgets the backend enforces on /ws/hook (token buckets): a hook sends a
# frame every 0.5 s or 5 steps, so even 100 steps a second use a fifth of this.
HOOK_FRAMES_PER_S = 100.0
HOOK_FRAMES_BURST = 500.0
HOOK_BYTES_PER_S = 4.0 * MAX_MESSAGE_BYTES
HOOK_BYTES_BURST = 32.0 * MAX_MESSAGE_BYTES
HOOK_HELLO_FRAMES = 50.0  # a hello costs SQL writes: it counts as this many frames (10 at once)

DASHBOARD_FRAMES_PER_S = 2.0  # a page sends its auth frame, nothing else
DASHBOARD_FRAMES_BURST = 20.0
DASHBOARD_MAX_FRAME_BYTES = 4096


class FrameBudget:
    """Frames and bytes per second with bursts (two token buckets, refilled lazily)."""

    def __init__(self, *, frames_per_s: float, frames_burst: float, bytes_per_s: float,
                 bytes_burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._base = (frames_per_s, bytes_per_s, frames_burst, bytes_burst)
        self._rates = (frames_per_s, bytes_per_s)
        self._bursts = (frames_burst, bytes_burst)
        self._frames, self._bytes = frames_burst, bytes_burst
        self._clock = clock
        self._at = clock()

    def widen(self, peers: int) -> None:
        """The connection now speaks for ``peers`` ranks (a node connection): each brings
        its own budget; what is left of the current buckets grows by the new share."""
        f_rate, b_rate, f_burst, b_burst = self._base
        scale = max(1, peers)
        added_f, added_b = f_burst * scale - self._bursts[0], b_burst * scale - self._bursts[1]
        self._rates = (f_rate * scale, b_rate * scale)
        self._bursts = (f_burst * scale, b_burst * scale)
        self._frames += max(0.0, added_f)
        self._bytes += max(0.0, added_b)

    def take(self, nbytes: int, frames: float = 1.0) -> str | None:
        """Charge ``frames`` frames of ``nbytes`` bytes; None if within budget, else why not."""
        now = self._clock()
        dt, self._at = max(now - self._at, 0.0), now
        self._frames = min(self._bursts[0], self._frames + dt * self._rates[0]) - frames
        self._bytes = min(self._bursts[1], self._bytes + dt * self._rates[1]) - nbytes
        if self._frames < 0:
            return (f"More than {self._bursts[0]:.0f} frames at once ({self._rates[0]:g} a second "
                    f"sustained) on one connection; send fewer, larger frames.")
        if self._bytes < 0:
            return (f"More than {self._bursts[1] / 2**20:g} MiB at once ({self._rates[1] / 2**20:g} MiB "
                    f"a second sustained) on one connection; send less.")
        return None

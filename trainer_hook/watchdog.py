"""Watchdog: names a rank that stopped stepping, with its training thread's Python stack.

A daemon thread wakes about once a second and reads where the training thread is (the
step timer's timestamps, the gradient state: plain attribute reads, no lock taken on the
hot path). When no step ended for ``after_s`` seconds (or five of the recent steps, if
longer) it takes the training thread's stack with ``sys._current_frames()`` (training goes
on: nothing is stopped or signalled) and hands one ``Hang`` report per stall to the
transport, which sends it on the metrics channel (docs/causes.md). The next step that ends
starts a new watch.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

from rebalancer_wire.protocol import MAX_STACK_CHARS, Hang

__all__ = ["Watchdog", "thread_stack", "STALL_STEPS"]

log = logging.getLogger("trainer_hook")
STALL_STEPS = 5.0  # a stall is at least this many of the rank's recent steps long

# Where the training thread is: (batch_index, phase, perf_counter of the last step's end,
# the recent step time in seconds), or None before the first step ended.
Where = Callable[[], tuple[int, str, float, float] | None]


def thread_stack(thread_id: int, limit: int = MAX_STACK_CHARS) -> str:
    """The Python stack of thread ``thread_id``, innermost frame last, cut to its last
    ``limit`` characters (the innermost frames are what says where it is stuck)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    text = "".join(traceback.format_stack(frame))
    if len(text) > limit:
        text = "...\n" + text[-(limit - 4):]
    return text


class Watchdog:
    """Reports a stall of the training thread through ``report`` (once per stall)."""

    def __init__(self, *, where: Where, report: Callable[[Hang], None], after_s: float, thread_id: int,
                 interval_s: float = 1.0, clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time) -> None:
        self._where = where
        self._report = report
        self.after_s = after_s
        self._thread_id = thread_id
        self._interval_s = interval_s
        self._clock = clock
        self._wall = wall
        self._stop = threading.Event()
        self._reported_for: float | None = None  # the step end whose stall was reported
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rebalancer-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watchdog must never take training down
                log.exception("the hang watchdog failed; it stops")
                return

    def check(self) -> Hang | None:
        """One look: the report when the training thread is newly stalled, else None."""
        where = self._where()
        if where is None:
            return None
        batch, phase, last_end, step_s = where
        stalled = self._clock() - last_end
        if stalled < max(self.after_s, STALL_STEPS * step_s) or self._reported_for == last_end:
            return None
        self._reported_for = last_end
        hang = Hang(batch_index=batch, phase=phase, since=self._wall() - stalled, stalled_s=stalled,
                    stack=thread_stack(self._thread_id))
        log.warning("no step ended for %.0f s: this rank is in %s of batch %d; stack sent to the backend",
                    stalled, phase, batch)
        self._report(hang)
        return hang

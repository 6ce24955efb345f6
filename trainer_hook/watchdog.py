"""Watchdog: names a rank that stopped stepping, with its training thread's Python stack.

A daemon thread wakes about once a second and reads where the training thread is (the
step timer's timestamps, the gradient state: plain attribute reads, no lock taken on the
hot path). When no step ended for ``after_s`` seconds (or five of the recent steps, if
longer) it takes the training thread's stack with ``sys._current_frames()`` (training goes
on: nothing is stopped or signalled) and hands one ``Hang`` report per stall to the
transport, which sends it on the metrics channel (docs/causes.md). The next step that ends
starts a new watch.

On CUDA, the report also names the file PyTorch's NCCL flight recorder writes when the
collective times out (``nccl_dump_path``), where the recorder and its dump are enabled.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping

from rebalancer_wire.protocol import MAX_PATH_CHARS, MAX_STACK_CHARS, Hang

__all__ = ["Watchdog", "thread_stack", "nccl_dump_path", "nccl_dump_here", "STALL_STEPS"]

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


# PyTorch's flight recorder (torch 2.13, torch/csrc/distributed/c10d/FlightRecorder.hpp and
# ProcessGroupNCCL.hpp): its ring buffer holds TORCH_FR_BUFFER_SIZE (or the older
# TORCH_NCCL_TRACE_BUFFER_SIZE) entries, 2000 by default, 0 turns it off; with
# TORCH_NCCL_DUMP_ON_TIMEOUT the NCCL watchdog writes it, on a collective's timeout, to the
# writer's prefix followed by the global rank: TORCH_FR_DUMP_TEMP_FILE (or the older
# TORCH_NCCL_DEBUG_INFO_TEMP_FILE), by default $XDG_CACHE_HOME/torch/comm_lib_trace_rank_,
# or $HOME/.cache/torch/comm_lib_trace_rank_ ($HOME defaulting to /tmp).
_FR_BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_FR_DEFAULT_ENTRIES = 2000
_FR_PREFIX = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
_FR_DUMP = "TORCH_NCCL_DUMP_ON_TIMEOUT"
_FR_FILE = "comm_lib_trace_rank_"
_TRUE = {"1", "y", "yes", "t", "true", "on"}


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        val = env.get(name)
        if val:
            return val
    return None


def nccl_dump_path(env: Mapping[str, str], rank: int, *, nccl: bool) -> str | None:
    """Where the NCCL flight recorder's dump of global rank ``rank`` goes, or None where no
    dump is made (not an NCCL job, the recorder off, or TORCH_NCCL_DUMP_ON_TIMEOUT unset).
    The file appears when the NCCL watchdog times the collective out; with
    TORCH_FR_DUMP_DYNAMIC_FILE_NAME the newest file beginning with the path is it, once
    written. A path longer than the wire allows is left out (None)."""
    if not nccl or rank < 0 or (env.get(_FR_DUMP) or "").strip().lower() not in _TRUE:
        return None
    entries = _first(env, _FR_BUFFER)
    try:
        if (int(entries) if entries is not None else _FR_DEFAULT_ENTRIES) <= 0:
            return None
    except ValueError:
        return None  # PyTorch would refuse the value too
    prefix = _first(env, _FR_PREFIX)
    if prefix is None:
        cache = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or "/tmp", ".cache")
        prefix = os.path.join(cache, "torch", _FR_FILE)
    path = f"{prefix}{rank}"
    if (env.get("TORCH_FR_DUMP_DYNAMIC_FILE_NAME") or "").strip().lower() in _TRUE:
        path = _newest_with_prefix(path) or path
    return path if len(path) <= MAX_PATH_CHARS and "\x00" not in path else None


def nccl_dump_here() -> str | None:
    """``nccl_dump_path`` for this process: its global rank, its default group's backend
    and its environment (None outside torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return nccl_dump_path(os.environ, dist.get_rank(), nccl="nccl" in str(dist.get_backend()).lower())


def _newest_with_prefix(prefix: str) -> str | None:
    folder, stem = os.path.split(prefix)
    try:
        names = [n for n in os.listdir(folder or ".") if n.startswith(stem)]
    except OSError:
        return None
    paths = [os.path.join(folder, n) for n in names]
    try:
        return max(paths, key=os.path.getmtime) if paths else None
    except OSError:
        return None


class Watchdog:
    """Reports a stall of the training thread through ``report`` (once per stall)."""

    def __init__(self, *, where: Where, report: Callable[[Hang], None], after_s: float, thread_id: int,
                 interval_s: float = 1.0, clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time, nccl_dump: Callable[[], str | None] | None = None) -> None:
        self._where = where
        self._report = report
        self.after_s = after_s
        self._thread_id = thread_id
        self._interval_s = interval_s
        self._clock = clock
        self._wall = wall
        self._nccl_dump = nccl_dump  # the flight recorder's dump path, read at each report
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
                    stack=thread_stack(self._thread_id),
                    nccl_dump=self._nccl_dump() if self._nccl_dump is not None else None)
        log.warning("no step ended for %.0f s: this rank is in %s of batch %d; stack sent to the backend",
                    stalled, phase, batch)
        self._report(hang)
        return hang

"""PhaseClock: the parts of a step the hook times beside its StepTimer (docs/causes.md).

- Python garbage-collection pauses per generation, from ``gc.callbacks`` (each callback
  takes one ``perf_counter()`` and adds one float: microseconds per collection, nothing
  per step).
- The loader's own time, around ``next()`` of the iterator ``hook.data_loader()`` gives,
  so that the wait before a step splits into the loader's and the host's other work.
- Checkpoint writes, inside ``hook.checkpointing()``.

``take`` hands the step's figures to the record and starts the next step's from zero. The
collector's callback may run on any thread (it pauses them all), so the accumulators are
swapped, never cleared in place.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["PhaseClock", "TimedIterator"]


class PhaseClock:
    """Accumulates GC pauses, loader time and checkpoint writes between two ``take``s."""

    __slots__ = ("_clock", "_gc", "_gc_t0", "_installed", "loader_s", "loader_timed", "ckpt_s")

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._gc = [0.0, 0.0, 0.0]
        self._gc_t0 = 0.0
        self._installed = False
        self.loader_s = 0.0
        self.loader_timed = False  # the hook's loader yielded at least once
        self.ckpt_s = 0.0

    # --- garbage collection ---------------------------------------------------------------

    def install(self) -> None:
        """Start timing the collector's pauses (idempotent)."""
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            try:
                gc.callbacks.remove(self._on_gc)
            except ValueError:  # someone cleared gc.callbacks
                pass
            self._installed = False

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = self._clock()
        else:
            gen = info.get("generation", 2)
            self._gc[gen if 0 <= gen <= 2 else 2] += self._clock() - self._gc_t0

    # --- loader and checkpoint ------------------------------------------------------------

    def add_loader(self, seconds: float) -> None:
        self.loader_s += seconds
        self.loader_timed = True

    def add_checkpoint(self, seconds: float) -> None:
        self.ckpt_s += seconds

    # --- per step -------------------------------------------------------------------------

    def take(self, gap_s: float, step_s: float) -> tuple[float | None, float | None, tuple[float, float, float] | None]:
        """``(host_ms, ckpt_ms, gc_ms)`` of the step that just ended, its wait before being
        ``gap_s`` and its whole ``step_s`` (seconds), each part clipped to its whole: the
        first step's gap is 0 whatever ran before it. None where not measured."""
        g = self._gc
        self._gc = [0.0, 0.0, 0.0]
        loader, ckpt = self.loader_s, self.ckpt_s
        self.loader_s = self.ckpt_s = 0.0
        ckpt = min(ckpt, gap_s)
        host_ms = max(0.0, gap_s - loader - ckpt) * 1e3 if self.loader_timed else None
        ckpt_ms = ckpt * 1e3 if ckpt > 0.0 else None
        gc_ms = None
        total = g[0] + g[1] + g[2]
        if total > 0.0:
            scale = min(1.0, step_s / total) * 1e3  # the pauses lie within the step
            gc_ms = (g[0] * scale, g[1] * scale, g[2] * scale)
        return host_ms, ckpt_ms, gc_ms


class TimedIterator:
    """An iterator whose ``next()`` time goes to a PhaseClock's loader time; every other
    attribute is the wrapped iterator's."""

    __slots__ = ("_it", "_phases", "_clock")

    def __init__(self, it: Iterator[Any], phases: PhaseClock) -> None:
        self._it = it
        self._phases = phases
        self._clock = phases._clock

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self) -> Any:
        t0 = self._clock()
        try:
            return next(self._it)
        finally:
            self._phases.add_loader(self._clock() - t0)

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)

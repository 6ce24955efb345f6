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

__all__ = ["PhaseClock", "TimedIterator", "GcSchedule"]


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


class GcSchedule:
    """``HookConfig(gc_freeze=..., gc_collect_every=...)``: the collector's settings for
    training (both off by default; docs/causes.md).

    - ``freeze``: at the first step, one collection, then ``gc.freeze()``: what setup built
      (model, optimizer, dataset) moves to the permanent generation, and no later
      collection walks it again.
    - ``collect_every`` N > 0: automatic full (generation 2) collections stop (its threshold
      goes out of reach; generations 0 and 1 stay automatic) and every rank collects in
      full before batch k for every k a multiple of N. Every rank trains the same batch
      indices, so they pause together without any collective: the pause costs the job
      once, not once per rank that happens to collect while the others wait for it.

    ``restore`` puts the collector's thresholds back and unfreezes (``close()``)."""

    __slots__ = ("freeze", "every", "_gc", "_saved", "_frozen", "_started")

    def __init__(self, *, freeze: bool, every: int, gc_module: Any = gc) -> None:
        self.freeze = freeze
        self.every = every
        self._gc = gc_module
        self._saved: tuple[int, ...] | None = None
        self._frozen = False
        self._started = False

    @property
    def active(self) -> bool:
        return self.freeze or self.every > 0

    def start(self) -> None:
        """The first step: freeze what setup built; take full collections over."""
        g = self._gc
        if self.freeze and not self._frozen:
            g.collect()
            g.freeze()
            self._frozen = True
        if self.every > 0 and self._saved is None:
            self._saved = tuple(g.get_threshold())
            t0, t1 = self._saved[0], self._saved[1] if len(self._saved) > 1 else 10
            g.set_threshold(t0, t1, _OUT_OF_REACH)

    def on_step(self, batch_index: int) -> None:
        """Before batch ``batch_index`` starts: the first step's set-up, then the
        synchronised full collection when due."""
        if not self._started:
            self._started = True
            self.start()
        elif self.every > 0 and batch_index % self.every == 0:
            self._gc.collect(2)

    def restore(self) -> None:
        g = self._gc
        if self._saved is not None:
            g.set_threshold(*self._saved)
            self._saved = None
        if self._frozen:
            g.unfreeze()
            self._frozen = False


_OUT_OF_REACH = 1 << 30  # a generation-2 threshold no run reaches: no automatic full collection

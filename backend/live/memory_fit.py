"""MemoryFitCache: one rank's peak-memory readings and their fit, refitted only when a
reading arrives (owned by the rank in ``LiveState``, which calls it under its lock).

The fit is ``backend.policy.memory.fit_memory``'s; this module only decides when to run
it: once per rank per new reading, whoever asks first (a view, the policy's inputs).
"""

from __future__ import annotations

from collections import deque

from backend.policy.memory import MemoryFit, MemoryReading, RankMemory, fit_memory
from rebalancer_wire.protocol import Hello

__all__ = ["MemoryFitCache", "MEMORY_READINGS"]

MEMORY_READINGS = 256  # peak-memory readings kept per rank (one every few steps)


class MemoryFitCache:
    """A rank's peak-memory readings (the step records that carry one), their fit, and the
    ``RankMemory`` summary built from them, rebuilt on first read after a change."""

    __slots__ = ("readings", "_fit", "_stale", "_summary")

    def __init__(self) -> None:
        self.readings: deque[MemoryReading] = deque(maxlen=MEMORY_READINGS)
        self._fit: MemoryFit | None = None
        self._stale = False
        self._summary: RankMemory | None = None

    def add(self, reading: MemoryReading) -> None:
        self.readings.append(reading)
        self._stale, self._summary = True, None

    def hello_changed(self) -> None:
        """The rank said hello again: its memory source or device total may differ."""
        self._summary = None

    @property
    def peak_bytes(self) -> int | None:
        """The newest reading's peak (None before the first)."""
        return self.readings[-1].peak_bytes if self.readings else None

    def summary(self, hello: Hello) -> RankMemory:
        """How the rank measures memory, the fit of its readings and the device's total."""
        if self._summary is not None:
            return self._summary
        if self._stale:
            # Micro-batch shares: a rank's peak does not grow with its count (docs/streaming.md).
            self._fit, self._stale = fit_memory(self.readings, flat=hello.micro_batches), False
        fit = self._fit
        last_total = self.readings[-1].total_bytes if self.readings else None
        total = last_total or (fit.total_bytes if fit else None) or \
            (hello.mem_total_bytes if hello.memory_source else None)
        self._summary = RankMemory(source=hello.memory_source, fit=fit, total_bytes=total)
        return self._summary

"""Peak device memory per step window: the memory source seam and the meter.

A :class:`MemorySource` reads the caching allocator's peak since its last reset, and
resets it. The allocator keeps these counters on the host as it hands out blocks, so
reading them never synchronises the device (``torch.cuda.max_memory_allocated`` and
``reset_peak_memory_stats`` do the same, but build a flat dict of every statistic on each
call; the nested-dict read below builds it once and picks three numbers).

- CUDA and ROCm (HIP builds of torch answer through ``torch.cuda``): :class:`TorchCudaMemory`.
- Intel XPU, where torch offers the statistics: :class:`TorchXpuMemory`.
- CPU: no source; the backend then applies no memory cap to the rank.

Tests inject their own source through ``RebalanceHook(memory_source=...)``: anything with
``name``, ``total_bytes()``, ``read_and_reset()`` and ``reset()``.

:class:`MemoryMeter` turns a source into readings at step boundaries. Reading costs tens of
microseconds on a GPU, so it reads once every ``every`` steps (default 8): the reading is the
peak over those steps, all at one local batch size (a change of the local batch starts a new
window). The first ``warmup`` steps after start are dropped: the allocator is still growing
its pools, and optimizer state appears after the first step. Between readings a step costs
one comparison and one increment.
"""

from __future__ import annotations

import logging
import sys
from typing import NamedTuple, Protocol

__all__ = ["MemorySource", "MemoryMeter", "MemoryReading", "TorchCudaMemory", "TorchXpuMemory",
           "default_memory_source", "is_out_of_memory"]

log = logging.getLogger(__name__)


class MemorySource(Protocol):
    """Where peak device memory comes from (the seam tests fake)."""

    name: str  # "cuda", "rocm", "xpu", ...: sent in hello.memory_source

    def total_bytes(self) -> int | None:
        """The device's memory in bytes (None if unknown)."""

    def read_and_reset(self) -> tuple[int, int | None]:
        """(peak allocated bytes since the last reset, bytes reserved now); then reset the peak."""

    def reset(self) -> None:
        """Reset the peak without reading it."""


class MemoryReading(NamedTuple):
    local_batch_size: int
    peak_bytes: int
    reserved_bytes: int | None
    total_bytes: int | None


class TorchCudaMemory:
    """The caching allocator of one CUDA (or ROCm/HIP) device."""

    def __init__(self, device: int) -> None:
        import torch

        self._torch = torch
        self._device = device
        self.name = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        try:
            self._total: int | None = int(torch.cuda.get_device_properties(device).total_memory)
        except Exception:  # noqa: BLE001 - a read that fails returns the sentinel
            self._total = None

    def total_bytes(self) -> int | None:
        return self._total

    def read_and_reset(self) -> tuple[int, int | None]:
        stats = self._torch.cuda.memory_stats_as_nested_dict(self._device)
        peak = int(stats.get("allocated_bytes", {}).get("all", {}).get("peak", 0))
        reserved = stats.get("reserved_bytes", {}).get("all", {}).get("current")
        self._torch.cuda.reset_peak_memory_stats(self._device)
        return peak, int(reserved) if reserved is not None else None

    def reset(self) -> None:
        self._torch.cuda.reset_peak_memory_stats(self._device)


class TorchXpuMemory:
    """The allocator of one Intel XPU device (torch 2.5+ keeps the same statistics)."""

    def __init__(self, device: int) -> None:
        import torch

        self._xpu = torch.xpu
        self._device = device
        self.name = "xpu"
        try:
            self._total: int | None = int(torch.xpu.get_device_properties(device).total_memory)
        except Exception:  # noqa: BLE001
            self._total = None

    def total_bytes(self) -> int | None:
        return self._total

    def read_and_reset(self) -> tuple[int, int | None]:
        stats = self._xpu.memory_stats_as_nested_dict(self._device)
        peak = int(stats.get("allocated_bytes", {}).get("all", {}).get("peak", 0))
        reserved = stats.get("reserved_bytes", {}).get("all", {}).get("current")
        self._xpu.reset_peak_memory_stats(self._device)
        return peak, int(reserved) if reserved is not None else None

    def reset(self) -> None:
        self._xpu.reset_peak_memory_stats(self._device)


def default_memory_source(device: int | None = None) -> MemorySource | None:
    """The source for this rank's accelerator, or None on CPU (or where torch offers no
    statistics). ``device`` defaults to torch's current device."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_available():
            dev = torch.cuda.current_device() if device is None else device
            return TorchCudaMemory(dev)
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and xpu.is_available() and hasattr(xpu, "memory_stats_as_nested_dict"):
            return TorchXpuMemory(xpu.current_device() if device is None else device)
    except Exception:  # noqa: BLE001 - no memory source is a valid answer
        log.debug("no device memory source", exc_info=True)
    return None


def is_out_of_memory(exc: BaseException | None) -> bool:
    """True for torch's out-of-memory error (CUDA, ROCm, XPU)."""
    if exc is None:
        return False
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return (oom is not None and isinstance(exc, oom)) or type(exc).__name__ == "OutOfMemoryError"


class MemoryMeter:
    """Reads a :class:`MemorySource` every ``every`` steps at one local batch size.

    Example (what the hook does around each step)::

        meter = MemoryMeter(source, every=8)
        meter.begin(local_batch_size)   # a new local batch size starts a new window
        ...                             # forward, backward, optimizer step
        reading = meter.end()           # a MemoryReading every 8 steps, else None
    """

    __slots__ = ("source", "every", "_n", "_local", "_warm", "_total")

    def __init__(self, source: MemorySource, *, every: int = 8, warmup: int = 2) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}.")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}.")
        self.source = source
        self.every = every
        self._local = -1
        self._warm = warmup > 0  # the first window is the warm-up, read and dropped
        self._n = every - warmup if warmup else 0
        self._total = source.total_bytes()

    def begin(self, local_batch_size: int) -> None:
        if local_batch_size != self._local:
            if self._local >= 0 and not self._warm:
                self._n = 0
                self.source.reset()  # a new size: the window restarts
            self._local = local_batch_size

    def end(self) -> MemoryReading | None:
        self._n += 1
        if self._n < self.every:
            return None
        self._n = 0
        peak, reserved = self.source.read_and_reset()
        if self._warm:
            self._warm = False
            return None
        return MemoryReading(self._local, peak, reserved, self._total)

    def peak_now(self) -> int | None:
        """The peak of the window so far, without resetting it (the out-of-memory report)."""
        try:
            peak, _ = self.source.read_and_reset()
            return peak
        except Exception:  # noqa: BLE001 - the report must go out whatever this says
            return None

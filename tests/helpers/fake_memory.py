"""The fake device memory source (the seam in trainer_hook.memory): no GPU here.

It stands for a caching allocator whose peak over a step is ``fixed_bytes +
bytes_per_sample * local_batch``; the training loop calls ``allocate(n)`` inside
``hook.step()`` with the samples it trains, and a step that would go past ``total`` raises
torch's own out-of-memory error, as a real allocator does.
"""

from __future__ import annotations

import torch


class FakeDeviceMemory:
    """A ``MemorySource`` with the memory behaviour of a model on a small or large card."""

    def __init__(self, *, total_bytes: int, fixed_bytes: int, bytes_per_sample: int,
                 name: str = "cuda") -> None:
        self.name = name
        self.total = total_bytes
        self.fixed = fixed_bytes
        self.per_sample = bytes_per_sample
        self.peak = fixed_bytes
        self.reads = 0

    def allocate(self, samples: int) -> None:
        """One step's forward and backward on ``samples`` samples."""
        need = self.fixed + self.per_sample * samples
        if need > self.total:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {need - self.fixed} bytes "
                f"(fake device of {self.total} bytes).")
        self.peak = max(self.peak, need)

    def total_bytes(self) -> int | None:
        return self.total

    def read_and_reset(self) -> tuple[int, int | None]:
        self.reads += 1
        peak, self.peak = self.peak, self.fixed
        return peak, self.fixed + self.per_sample * 4

    def reset(self) -> None:
        self.peak = self.fixed

"""The device the GPU checks run on: a real CUDA device, or its CPU rehearsal.

``scripts/gpu-check`` runs ``tests/gpu`` on a CUDA machine; ``scripts/gpu-check --rehearse``
sets ``REBALANCER_GPU_REHEARSAL=1`` and runs the same tests here on CPU, each GPU part
replaced by a stand-in with the same interface, so every test's logic and the script's
plumbing have run before the first (short, rare) session on a real device:

- timing events: :class:`HostEvent` (a host timestamp at ``record()``; CPU work is
  synchronous, so that is when the "device" got there), put in place of ``torch.cuda.Event``
  where the hook looks for a device's event class (``trainer_hook.gradients``);
- an injected GPU delay (``torch.cuda._sleep``, calibrated) becomes a busy loop on the host;
- NVML: the fake pynvml of tests/helpers/nvml.py, its device set from the rehearsal's figures;
- the caching allocator: tests.helpers.fake_memory.FakeDeviceMemory.

``REBALANCER_GPU_FACTS``: a folder where the tests write what they measured (``*.json``),
which gpu-check gathers into its results file.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REHEARSAL_ENV = "REBALANCER_GPU_REHEARSAL"
FACTS_ENV = "REBALANCER_GPU_FACTS"
REHEARSAL_NAME = "Rehearsal CPU stand-in"


def rehearsal() -> bool:
    return os.environ.get(REHEARSAL_ENV) == "1"


def cuda() -> bool:
    return torch.cuda.is_available()


def skip_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can (CUDA, or the rehearsal)."""
    if cuda() or rehearsal():  # with CUDA the real checks run, rehearsal or not
        return None
    return (f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False); "
            f"on a CUDA machine run scripts/gpu-check, here scripts/gpu-check --rehearse")


def write_fact(name: str, value: dict[str, Any]) -> None:
    """Keep a measured figure for gpu-check's results file (no-op without REBALANCER_GPU_FACTS)."""
    folder = os.environ.get(FACTS_ENV)
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"{name}.json").write_text(json.dumps(value, indent=1, default=str))


class HostEvent:
    """``torch.cuda.Event``'s interface on the host, for the rehearsal."""

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return self.t is not None

    def elapsed_time(self, end: HostEvent) -> float:
        if self.t is None or end.t is None:
            raise RuntimeError("HostEvent.elapsed_time: both events must be recorded first.")
        return (end.t - self.t) * 1e3

    def synchronize(self) -> None:  # the hook must never call it
        raise AssertionError("the hook synchronised on a timing event (hot path: no device sync)")


@dataclass
class Rig:
    """One device for the checks: ``cuda:0``, or the CPU in rehearsal."""

    device: torch.device
    is_cuda: bool
    _cycles_per_ms: float | None = field(default=None, repr=False)

    @classmethod
    def detect(cls) -> Rig:
        if cuda():
            torch.cuda.set_device(0)
            return cls(torch.device("cuda", 0), True)
        return cls(torch.device("cpu"), False)

    @property
    def kind(self) -> str:
        return "cuda" if self.is_cuda else "rehearsal"

    @property
    def dist_backend(self) -> str:
        return "nccl" if self.is_cuda else "gloo"

    def name(self) -> str:
        return torch.cuda.get_device_name(0) if self.is_cuda else REHEARSAL_NAME

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()  # a CPU-GPU sync point (the test's, never the hook's)

    def event(self) -> Any:
        return torch.cuda.Event(enable_timing=True) if self.is_cuda else HostEvent(enable_timing=True)

    def cycles_per_ms(self) -> float:
        """``torch.cuda._sleep`` cycles per millisecond, measured once with events."""
        if self._cycles_per_ms is None:
            cycles = 10_000_000  # a few milliseconds: long enough for the events' resolution
            torch.cuda._sleep(cycles)  # warm-up
            start, end = self.event(), self.event()
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._cycles_per_ms = cycles / max(start.elapsed_time(end), 1e-3)
        return self._cycles_per_ms

    def busy(self, ms: float) -> None:
        """Keep the device busy for ``ms`` milliseconds (queued, on CUDA: the host returns at once)."""
        if self.is_cuda:
            torch.cuda._sleep(max(1, int(ms * self.cycles_per_ms())))
            return
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            pass

    def nvml(self) -> Any:
        """The NVML module the probe reads: pynvml with a driver, else the fake in rehearsal."""
        if self.is_cuda:
            from trainer_hook.probe import load_nvml

            return load_nvml()
        from tests.helpers.nvml import FakeGpu, FakeNvml

        return FakeNvml([FakeGpu(name=REHEARSAL_NAME, uuid="GPU-rehearsal", mem_total=2 * 2**30, energy_mj=None,
                                 mem_used=2**30, util_gpu=90, sm_clock=1500, sm_clock_max=1980)])

    def use_host_events(self, monkeypatch: Any = None) -> None:
        """Rehearsal: make the hook take CPU tensors for a device with timing events, so the
        event path (recorded events, read a step later with query()) runs here. With a
        pytest ``monkeypatch`` the change is undone after the test; without (a torchrun
        worker), it lasts the process."""
        if self.is_cuda:
            return
        from trainer_hook import gradients

        set_attr = monkeypatch.setattr if monkeypatch is not None else setattr
        set_attr(gradients, "_tensor_event", lambda t: HostEvent)
        set_attr(gradients, "timing_event", lambda device_type: HostEvent)
        # The Python comm hook records events; the C++ one takes host timestamps.
        if monkeypatch is not None:
            monkeypatch.setenv("REBALANCER_NATIVE_COMM_HOOK", "0")
        else:
            os.environ["REBALANCER_NATIVE_COMM_HOOK"] = "0"

    # --- device memory: torch's caching allocator, or the rehearsal's host ledger ----------

    def memory(self) -> DeviceMemory:
        return DeviceMemory(self.is_cuda)


class DeviceMemory:
    """Allocations on the device with torch.cuda's figures beside them; in the rehearsal a
    ledger of host allocations that keeps the same figures (and is the hook's MemorySource,
    as ``TorchCudaMemory`` is on CUDA)."""

    name = "cuda"

    def __init__(self, is_cuda: bool) -> None:
        self.is_cuda = is_cuda
        self._allocated = 0
        self._peak = 0
        self._sizes: dict[int, int] = {}

    def alloc(self, nbytes: int) -> torch.Tensor:
        if self.is_cuda:
            return torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        t = torch.empty(nbytes, dtype=torch.uint8)
        self._sizes[id(t)] = nbytes
        self._allocated += nbytes
        self._peak = max(self._peak, self._allocated)
        return t

    def free(self, t: torch.Tensor) -> None:
        if not self.is_cuda:
            self._allocated -= self._sizes.pop(id(t))

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(0) if self.is_cuda else self._peak

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(0) if self.is_cuda else self._allocated

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved(0) if self.is_cuda else self._allocated

    def source(self) -> Any:
        """The hook's memory source for this device."""
        if self.is_cuda:
            from trainer_hook.memory import default_memory_source

            return default_memory_source(0)
        return self

    # MemorySource (the rehearsal's)
    def total_bytes(self) -> int | None:
        return 2 * 2**30

    def read_and_reset(self) -> tuple[int, int | None]:
        peak, self._peak = self._peak, self._allocated
        return peak, self._allocated

    def reset(self) -> None:
        self._peak = self._allocated

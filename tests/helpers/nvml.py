"""A small stand-in for the pynvml module, for machines without an NVIDIA GPU: the one
fake NVML of the tests. In-process tests pass ``FakeNvml([...])`` to ``DeviceProbe``;
torchrun workers import it as ``pynvml`` through tests/helpers/fake_nvml/.

It exposes the functions DeviceProbe calls with the real signatures and units (memory in
bytes, power in milliwatts, energy in millijoules, clocks in MHz), holds per-device state
the test sets, counts calls, and can make any function fail the way NVML fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_GpuIsLost(NVMLError):
    pass


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    util_gpu: int = 87
    mem_used: int = 30 * 2**30
    mem_total: int = 80 * 2**30
    power_mw: int = 512_000
    energy_mj: int | None = 1_000_000
    temp_c: int = 71
    sm_clock: int = 1755
    sm_clock_max: int = 1980
    reasons: int = 0
    # Link counters: PCIe KiB/s (None: not supported), NVLink cumulative KiB (None: no NVLink).
    pcie_tx_kib_s: int | None = 2_000_000
    pcie_rx_kib_s: int | None = 1_000_000
    nvlink_tx_kib: int | None = None
    nvlink_rx_kib: int | None = None
    # function name -> exception instance raised instead of answering
    fail: dict[str, Exception] = field(default_factory=dict)


class FakeNvml:
    """Module-like object: pass it as ``DeviceProbe(nvml=FakeNvml([...]))``."""

    NVML_CLOCK_SM = NVML_CLOCK_SM
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported

    def __init__(self, gpus: list[FakeGpu] | None = None, *, old_driver: bool = False) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        self.calls: dict[str, int] = {}
        if old_driver:  # drivers before 535 lack the "ClocksEvent" spelling
            self.nvmlDeviceGetCurrentClocksEventReasons = None  # type: ignore[assignment]

    def _gpu(self, fn: str, handle: Any) -> FakeGpu:
        self.calls[fn] = self.calls.get(fn, 0) + 1
        gpu = self.gpus[handle]
        if fn in gpu.fail:
            raise gpu.fail[fn]
        return gpu

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.gpus):
            raise NVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        for i, g in enumerate(self.gpus):
            if g.uuid == uuid:
                return i
        raise NVMLError("Not Found")

    def nvmlDeviceGetIndex(self, h: int) -> int:
        self._gpu("nvmlDeviceGetIndex", h)
        return h

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self._gpu("nvmlDeviceGetUUID", h).uuid

    def nvmlDeviceGetName(self, h: int) -> str:
        return self._gpu("nvmlDeviceGetName", h).name

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._gpu("nvmlDeviceGetUtilizationRates", h).util_gpu, memory=10)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        g = self._gpu("nvmlDeviceGetMemoryInfo", h)
        return SimpleNamespace(total=g.mem_total, used=g.mem_used, free=g.mem_total - g.mem_used)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._gpu("nvmlDeviceGetPowerUsage", h).power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        g = self._gpu("nvmlDeviceGetTotalEnergyConsumption", h)
        if g.energy_mj is None:
            raise NVMLError_NotSupported("Not Supported")
        return g.energy_mj

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == NVML_TEMPERATURE_GPU
        return self._gpu("nvmlDeviceGetTemperature", h).temp_c

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        assert clock == NVML_CLOCK_SM
        return self._gpu("nvmlDeviceGetClockInfo", h).sm_clock

    def nvmlDeviceGetMaxClockInfo(self, h: int, clock: int) -> int:
        assert clock == NVML_CLOCK_SM
        return self._gpu("nvmlDeviceGetMaxClockInfo", h).sm_clock_max

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._gpu("nvmlDeviceGetCurrentClocksEventReasons", h).reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> int:
        return self._gpu("nvmlDeviceGetCurrentClocksThrottleReasons", h).reasons

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        gpu = self._gpu("nvmlDeviceGetPcieThroughput", h)
        value = gpu.pcie_tx_kib_s if counter == 0 else gpu.pcie_rx_kib_s
        if value is None:
            raise NVMLError_NotSupported("Not Supported")
        return value

    def nvmlDeviceGetFieldValues(self, h: int, field_ids: list[Any]) -> list[SimpleNamespace]:
        gpu = self._gpu("nvmlDeviceGetFieldValues", h)
        out = []
        for f in field_ids:
            fid = f[0] if isinstance(f, tuple) else f
            value = {138: gpu.nvlink_tx_kib, 139: gpu.nvlink_rx_kib}.get(fid)
            out.append(SimpleNamespace(fieldId=fid, nvmlReturn=0 if value is not None else 3,
                                       value=SimpleNamespace(ullVal=value or 0)))
        return out

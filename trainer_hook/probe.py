"""Device probe: samples this rank's accelerator about once a second off the training thread.

With an NVIDIA GPU it reads NVML through ``pynvml`` (package nvidia-ml-py): utilisation,
memory, power, temperature, SM clocks and clock-event (throttle) reasons. NVML calls
serialise in the driver, so the handle is cached, sampling runs on a daemon thread at
about 1 Hz, and average power comes from the energy counter (exact over the interval)
when the device has one. Every NVML read is guarded: a failing read gives None. Without
NVML it falls back to psutil: process CPU and RSS, system memory.

One module, over 400 lines on purpose: the probe thread and its two sources (NVML through
pynvml, the CPU fallback) with the decoding of NVML's readings."""

from __future__ import annotations

import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from rebalancer_wire.devices import CLOCK_EVENT_NAMES, device_key
from rebalancer_wire.protocol import LINK_FIELDS, DeviceSample
from trainer_hook.links import LinkCounters

__all__ = ["CLOCK_EVENT_NAMES", "DeviceProbe", "device_type_key", "decode_clock_events", "load_nvml"]

log = logging.getLogger(__name__)

# nvmlClocksEventReason* bits (nvml.h); stable ABI values, checked against pynvml in tests.
_NVML_CLOCK_SM = 1
_NVML_TEMPERATURE_GPU = 0

def device_type_key(name: str, mem_total_bytes: int | None = None) -> str:
    """The device table's key for a device name (``rebalancer_wire.devices.device_key``, the
    one rule the backend's policy uses too); a name that matches no key comes back
    stripped, so the backend can still show it."""
    return device_key(name, mem_total_bytes) or name.strip()


def _name_and_memory(props: Any) -> tuple[str, int | None]:
    total = getattr(props, "total_memory", None)
    return str(props.name), int(total) if isinstance(total, int) else None


def decode_clock_events(mask: int) -> list[str]:
    """Names of the clock-event (throttle) reasons set in an NVML bitmask, lowest bit first."""
    names = [n for bit, n in CLOCK_EVENT_NAMES.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_EVENT_NAMES)
    if unknown:
        names.append(f"unknown_{unknown:#x}")
    return names


def load_nvml() -> ModuleType | None:
    """Import pynvml and initialise NVML; None when the package or a driver is missing."""
    try:
        import pynvml  # type: ignore[import-untyped]
    except Exception:  # noqa: BLE001 - optional dependency
        return None
    try:
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            return None
    except Exception:  # noqa: BLE001 - no driver / no GPU
        return None
    return pynvml  # type: ignore[no-any-return]


def _visible_device(index: int) -> str | int:
    """NVML numbers every GPU on the machine; CUDA only the visible ones. Map across."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        return index
    entry = entries[index]
    return int(entry) if entry.isdigit() else entry  # "GPU-<uuid>" or "MIG-<uuid>"


def _default_index() -> int:
    torch = sys.modules.get("torch")  # never import torch just for this
    try:
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:  # noqa: BLE001
        pass
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


class DeviceProbe:
    """Samples one device about once a second on a daemon thread.

    Example::

        probe = DeviceProbe(interval_s=1.0, on_sample=transport.put_device)
        device_type, device_name, mem_total = probe.describe()   # ("H100", "NVIDIA H100 ...", ...)
        gpu_index, gpu_uuid = probe.identity()                   # (3, "GPU-8d6f...") or (None, "")
        probe.start()
        ...
        probe.latest()   # newest DeviceSample or None
        probe.stop()

    ``device_index`` is the CUDA device index (as torch counts it); by default the current
    torch device, else ``LOCAL_RANK``. ``nvml`` injects a pynvml-like module (tests); by
    default pynvml is loaded if a driver is present. ``clock``/``wall`` are the monotonic
    and Unix clocks, injectable to test the power arithmetic. Each sample also carries the
    node's link rates (``trainer_hook.links``: NICs, InfiniBand under ``sysfs``, PCIe,
    NVLink), None where a counter is absent.
    """

    def __init__(
        self,
        *,
        interval_s: float = 1.0,
        device_index: int | None = None,
        on_sample: Callable[[DeviceSample], None] | None = None,
        nvml: ModuleType | Any | None = None,
        use_nvml: bool = True,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sysfs: str = "/sys",
    ) -> None:
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ValueError(f"interval_s must be a number > 0, got {interval_s!r}.")
        if device_index is not None and (not isinstance(device_index, int) or device_index < 0):
            raise ValueError(f"device_index must be an integer >= 0 or None, got {device_index!r}.")
        self.interval_s = float(interval_s)
        self._on_sample = on_sample
        self._clock = clock
        self._wall = wall
        self._latest: DeviceSample | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsupported: set[str] = set()
        self._energy: tuple[float, float] | None = None  # (mJ, clock) of the previous read
        self._nvml = nvml if nvml is not None else (load_nvml() if use_nvml else None)
        self._handle: Any = None
        self._explicit_index = device_index is not None
        self._index = device_index if device_index is not None else _default_index()
        if self._nvml is not None:
            index = self._index
            self._handle = self._get_handle(index)
            if self._handle is None:
                log.warning("NVML has no device for CUDA index %d; falling back to psutil.", index)
                self._nvml = None
        self._psutil: Any = None
        self._proc: Any = None
        if self._nvml is None:
            self._init_psutil()
        self._max_sm: float | None = self._q("nvmlDeviceGetMaxClockInfo", _NVML_CLOCK_SM)
        self._links = LinkCounters(nvml=self._nvml, handle=self._handle, psutil=_import_psutil(), sysfs=sysfs,
                                   clock=clock)

    @property
    def source(self) -> str:
        """"nvml" or "psutil": where samples come from."""
        return "nvml" if self._nvml is not None else "psutil"

    # --- guarded reads -------------------------------------------------------------------

    def _q(self, fn_name: str, *args: Any) -> Any:
        """Call an NVML device function on the cached handle; None if it fails."""
        if self._nvml is None or fn_name in self._unsupported:
            return None
        fn = getattr(self._nvml, fn_name, None)
        if fn is None:
            self._unsupported.add(fn_name)
            return None
        try:
            return fn(self._handle, *args)
        except Exception as exc:  # noqa: BLE001 - hardware reads return a sentinel
            if type(exc).__name__ == "NVMLError_NotSupported":
                self._unsupported.add(fn_name)  # stop paying the driver for it every second
            return None

    def _get_handle(self, index: int) -> Any:
        nv: Any = self._nvml
        target = _visible_device(index)
        try:
            if isinstance(target, str):
                return nv.nvmlDeviceGetHandleByUUID(target)
            return nv.nvmlDeviceGetHandleByIndex(target)
        except Exception:  # noqa: BLE001
            return None

    def _init_psutil(self) -> None:
        try:
            import psutil
        except Exception:  # noqa: BLE001 - optional dependency
            log.warning("Neither NVML nor psutil is available; device samples will be empty.")
            return
        self._psutil = psutil
        try:
            self._proc = psutil.Process()
            self._proc.cpu_percent(None)  # the first call only sets the baseline
            psutil.cpu_percent(None)
        except Exception:  # noqa: BLE001
            self._proc = None

    # --- sampling ------------------------------------------------------------------------

    def describe(self) -> tuple[str, str, int | None]:
        """(device_type key, device name, total memory in bytes or None)."""
        if self._nvml is not None:
            name = self._q("nvmlDeviceGetName")
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            mem = self._q("nvmlDeviceGetMemoryInfo")
            total = _int_attr(mem, "total")
            name = str(name) if name else "NVIDIA GPU"
            return device_type_key(name, total), name, total
        accel = self._torch_device()
        if accel is not None:
            return device_type_key(accel[0], accel[1]), accel[0], accel[1]
        total = None
        if self._psutil is not None:
            try:
                total = int(self._psutil.virtual_memory().total)
            except Exception:  # noqa: BLE001
                total = None
        return "CPU", _cpu_name(), total

    def identity(self) -> tuple[int | None, str]:
        """(NVML device index, UUID) of this rank's GPU: dcgm-exporter's ``gpu`` and
        ``UUID`` labels, so the backend's series join DCGM's. ``(None, "")`` without NVML."""
        if self._nvml is None:
            return None, ""
        index = self._q("nvmlDeviceGetIndex")
        uuid = self._q("nvmlDeviceGetUUID")
        if isinstance(uuid, bytes):
            uuid = uuid.decode(errors="replace")
        return (int(index) if isinstance(index, int) and not isinstance(index, bool) else None,
                str(uuid)[:128] if uuid else "")

    def _torch_device(self) -> tuple[str, int | None] | None:
        """(name, memory) of this rank's accelerator as torch sees it, when NVML cannot see
        it (AMD GPUs under ROCm, NVIDIA without NVML, Intel XPU, Apple MPS); None for a CPU
        rank. A device counts once this process uses it (initialised, or memory allocated
        on MPS), so a CPU rank on a machine that has one is still a CPU rank."""
        torch = sys.modules.get("torch")  # a rank that never imported torch trains on no GPU
        if torch is None:
            return None
        try:
            if torch.cuda.is_available():
                if not (self._explicit_index or torch.cuda.is_initialized()):
                    return None
                return _name_and_memory(torch.cuda.get_device_properties(self._index))
            xpu = getattr(torch, "xpu", None)
            if xpu is not None and xpu.is_available() and xpu.is_initialized():
                return _name_and_memory(xpu.get_device_properties(xpu.current_device()))
            mps = getattr(torch, "mps", None)
            if mps is not None and torch.backends.mps.is_available() and mps.current_allocated_memory() > 0:
                # torch names no Apple chip; the memory is what Metal lets one process use.
                total = mps.recommended_max_memory() if hasattr(mps, "recommended_max_memory") else None
                return "Apple MPS", int(total) if isinstance(total, int) else None
            return None
        except Exception:  # noqa: BLE001 - a read that fails returns the sentinel
            return None

    def sample_now(self) -> DeviceSample:
        """Take one sample on the calling thread and store it as ``latest()``."""
        sample = self._sample_nvml() if self._nvml is not None else self._sample_psutil()
        try:
            rates = self._links.read()
            for name, value in zip(LINK_FIELDS, (rates.nic_tx, rates.nic_rx, rates.ib_tx, rates.ib_rx, rates.pcie_tx,
                                                 rates.pcie_rx, rates.nvlink_tx, rates.nvlink_rx), strict=True):
                setattr(sample, name, value)
        except Exception:  # noqa: BLE001 - a link counter must never cost the device sample
            log.debug("link counters failed", exc_info=True)
        with self._lock:
            self._latest = sample
        return sample

    def _sample_nvml(self) -> DeviceSample:
        now = self._clock()
        util = self._q("nvmlDeviceGetUtilizationRates")
        mem = self._q("nvmlDeviceGetMemoryInfo")
        power_w = None
        energy_mj = self._q("nvmlDeviceGetTotalEnergyConsumption")
        if energy_mj is not None:
            prev, self._energy = self._energy, (float(energy_mj), now)
            # Energy difference over time difference: the exact mean power of the interval.
            if prev is not None and now > prev[1] and energy_mj >= prev[0]:
                power_w = (energy_mj - prev[0]) / 1000.0 / (now - prev[1])
        if power_w is None:
            mw = self._q("nvmlDeviceGetPowerUsage")  # instantaneous-ish, in milliwatts
            power_w = mw / 1000.0 if mw is not None else None
        temp = self._q("nvmlDeviceGetTemperature", _NVML_TEMPERATURE_GPU)
        sm = self._q("nvmlDeviceGetClockInfo", _NVML_CLOCK_SM)
        if self._max_sm is None:
            self._max_sm = self._q("nvmlDeviceGetMaxClockInfo", _NVML_CLOCK_SM)
        mask = self._q("nvmlDeviceGetCurrentClocksEventReasons")
        if mask is None:  # drivers before 535 only know the old name
            mask = self._q("nvmlDeviceGetCurrentClocksThrottleReasons")
        return DeviceSample(
            t=self._wall(),
            source="nvml",
            util_pct=_float_attr(util, "gpu"),
            mem_used_bytes=_int_attr(mem, "used"),
            mem_total_bytes=_int_attr(mem, "total"),
            power_w=power_w,
            temp_c=float(temp) if isinstance(temp, (int, float)) else None,
            sm_clock_mhz=float(sm) if isinstance(sm, (int, float)) else None,
            sm_clock_max_mhz=float(self._max_sm) if isinstance(self._max_sm, (int, float)) else None,
            throttle_reasons=decode_clock_events(mask) if isinstance(mask, int) else [],
        )

    def _sample_psutil(self) -> DeviceSample:
        ps, proc = self._psutil, self._proc
        sample = DeviceSample(t=self._wall(), source="psutil")
        if ps is None:
            return sample
        for attr, read in (
            ("util_pct", lambda: float(ps.cpu_percent(None))),  # whole machine, 0..100
            ("cpu_pct", lambda: float(proc.cpu_percent(None))),  # this process; >100 = threads
            ("rss_bytes", lambda: int(proc.memory_info().rss)),
        ):
            try:
                setattr(sample, attr, read())
            except Exception:  # noqa: BLE001
                pass
        try:
            vm = ps.virtual_memory()
            sample.mem_total_bytes = int(vm.total)
            sample.mem_used_bytes = int(vm.total - vm.available)
        except Exception:  # noqa: BLE001
            pass
        return sample

    def latest(self) -> DeviceSample | None:
        """The newest sample, or None before the first one."""
        with self._lock:
            return self._latest

    # --- thread ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start sampling every ``interval_s`` seconds on a daemon thread (idempotent)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rebalancer-probe", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the sampling thread (returns within about one NVML read)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def after_fork_in_child(self) -> None:
        """A forked child: the sampling thread is gone; forget the NVML handle (no
        ``nvmlShutdown``: NVML state belongs to the parent) and sample nothing more."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stop.set()
        self._thread = None
        self._handle = None
        self._nvml = None

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self._clock()
            try:
                sample = self.sample_now()
                if self._on_sample is not None:
                    self._on_sample(sample)
            except Exception:  # noqa: BLE001 - the probe must never die or reach training
                log.exception("Device probe sample failed; will retry.")
            # Keep a steady cadence: subtract the time the reads took.
            self._stop.wait(max(0.0, self.interval_s - (self._clock() - started)))


def _import_psutil() -> Any:
    try:
        import psutil
    except ImportError:  # optional dependency: no NIC rates
        return None
    return psutil


def _int_attr(obj: Any, name: str) -> int | None:
    val = getattr(obj, name, None)
    return int(val) if isinstance(val, (int, float)) and not isinstance(val, bool) else None


def _float_attr(obj: Any, name: str) -> float | None:
    val = getattr(obj, name, None)
    return float(val) if isinstance(val, (int, float)) and not isinstance(val, bool) else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()[:128]
    except OSError:
        pass
    return (platform.processor() or platform.machine() or "CPU")[:128]

"""Link counters: the bytes per second a rank's node moves over its links, where the
hardware has counters. Read on the probe's thread (about 1 Hz), never on the training one.

- host NICs (psutil, every machine): bytes sent and received over all interfaces but
  loopback, as rates between two reads;
- InfiniBand (sysfs, where present): ``/sys/class/infiniband/*/ports/*/counters/
  port_{xmit,rcv}_data``, cumulative in units of 4 bytes (one per lane), summed over ports;
- PCIe (NVML ``nvmlDeviceGetPcieThroughput``): KiB/s over a 20 ms window inside the driver,
  so read no more often than every ``pcie_every_s`` seconds (5 by default) and carried in
  between;
- NVLink (NVML field values ``NVLINK_THROUGHPUT_DATA_TX/RX``, cumulative KiB over all
  links): rates between two reads.

A counter that is absent (no such hardware, no permission, an old driver) reads None,
never 0. A counter that goes backwards (a reset, a wrap) gives None for that interval.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["LinkCounters", "LinkRates", "PCIE_EVERY_S"]

PCIE_EVERY_S = 5.0
_PCIE_TX, _PCIE_RX = 0, 1  # NVML_PCIE_UTIL_TX_BYTES / _RX_BYTES
_NVLINK_TX, _NVLINK_RX = 138, 139  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX / _RX, KiB
_ALL_LINKS = 0xFFFFFFFF  # scope id: the sum over every link
_IB_WORD = 4  # port_xmit_data / port_rcv_data count 4-byte words


@dataclass(slots=True)
class LinkRates:
    """Bytes per second each way over one kind of link (None: no counter)."""

    nic_tx: float | None = None
    nic_rx: float | None = None
    ib_tx: float | None = None
    ib_rx: float | None = None
    pcie_tx: float | None = None
    pcie_rx: float | None = None
    nvlink_tx: float | None = None
    nvlink_rx: float | None = None


def _rate(prev: tuple[float, float] | None, now: tuple[float, float]) -> float | None:
    """(value, time) pairs to a rate; None for no previous read, no time, or a reset."""
    if prev is None or now[1] <= prev[1] or now[0] < prev[0]:
        return None
    return (now[0] - prev[0]) / (now[1] - prev[1])


class LinkCounters:
    """Reads every link counter this node has; ``read()`` returns the rates since the
    previous read (None on the first read and where a counter is absent).

    ``nvml``/``handle``: a pynvml-like module and the device handle (None: no GPU links);
    ``psutil``: the module or None (no NIC rates); ``sysfs``: the root holding
    ``class/infiniband``; ``clock``: monotonic seconds (injectable for tests).
    """

    def __init__(self, *, nvml: Any = None, handle: Any = None, psutil: Any = None, sysfs: str = "/sys",
                 pcie_every_s: float = PCIE_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(pcie_every_s, bool) or not isinstance(pcie_every_s, (int, float)) or pcie_every_s < 1.0:
            raise ValueError(f"pcie_every_s must be a number >= 1 (NVML's PCIe read blocks ~20 ms), got {pcie_every_s!r}.")
        self._nvml, self._handle, self._psutil = nvml, handle, psutil
        self._clock = clock
        self._pcie_every_s = float(pcie_every_s)
        self._pcie_at: float | None = None
        self._pcie: tuple[float | None, float | None] = (None, None)
        self._prev: dict[str, tuple[float, float]] = {}
        self._dead: set[str] = set()  # counters that failed as unsupported: not asked again
        self._ib_files = self._find_ib(sysfs)

    @staticmethod
    def _find_ib(sysfs: str) -> tuple[list[str], list[str]]:
        base = os.path.join(sysfs, "class", "infiniband", "*", "ports", "*", "counters")
        return (sorted(glob.glob(os.path.join(base, "port_xmit_data"))),
                sorted(glob.glob(os.path.join(base, "port_rcv_data"))))

    def read(self) -> LinkRates:
        now = self._clock()
        out = LinkRates()
        nic = self._nic()
        if nic is not None:
            out.nic_tx = self._delta("nic_tx", nic[0], now)
            out.nic_rx = self._delta("nic_rx", nic[1], now)
        tx_files, rx_files = self._ib_files
        if tx_files:
            tx, rx = _sum_files(tx_files), _sum_files(rx_files)
            out.ib_tx = self._delta("ib_tx", tx * _IB_WORD, now) if tx is not None else None
            out.ib_rx = self._delta("ib_rx", rx * _IB_WORD, now) if rx is not None else None
        if self._nvml is not None:
            out.pcie_tx, out.pcie_rx = self._pcie_rates(now)
            nv = self._nvlink()
            if nv is not None:
                out.nvlink_tx = self._delta("nvlink_tx", nv[0] * 1024.0, now)
                out.nvlink_rx = self._delta("nvlink_rx", nv[1] * 1024.0, now)
        return out

    def _delta(self, key: str, value: float, now: float) -> float | None:
        prev = self._prev.get(key)
        self._prev[key] = (value, now)
        return _rate(prev, (value, now))

    def _nic(self) -> tuple[float, float] | None:
        ps = self._psutil
        if ps is None or "nic" in self._dead:
            return None
        try:
            per = ps.net_io_counters(pernic=True)
        except Exception:  # noqa: BLE001 - a read that fails returns the sentinel
            return None
        nics = [c for name, c in per.items() if name != "lo" and not name.startswith("lo")]
        if not nics:
            self._dead.add("nic")
            return None
        return float(sum(c.bytes_sent for c in nics)), float(sum(c.bytes_recv for c in nics))

    def _pcie_rates(self, now: float) -> tuple[float | None, float | None]:
        if "pcie" in self._dead:
            return None, None
        if self._pcie_at is not None and now - self._pcie_at < self._pcie_every_s:
            return self._pcie
        self._pcie_at = now
        fn = getattr(self._nvml, "nvmlDeviceGetPcieThroughput", None)
        if fn is None:
            self._dead.add("pcie")
            return None, None
        vals: list[float | None] = []
        for counter in (_PCIE_TX, _PCIE_RX):
            try:
                kbps = fn(self._handle, counter)
                vals.append(float(kbps) * 1024.0 if isinstance(kbps, (int, float)) and kbps >= 0 else None)
            except Exception as exc:  # noqa: BLE001
                if type(exc).__name__ == "NVMLError_NotSupported":
                    self._dead.add("pcie")
                vals.append(None)
        self._pcie = (vals[0], vals[1])
        return self._pcie

    def _nvlink(self) -> tuple[float, float] | None:
        if "nvlink" in self._dead:
            return None
        fn = getattr(self._nvml, "nvmlDeviceGetFieldValues", None)
        if fn is None:
            self._dead.add("nvlink")
            return None
        try:
            got = fn(self._handle, [(_NVLINK_TX, _ALL_LINKS), (_NVLINK_RX, _ALL_LINKS)])
        except Exception:  # noqa: BLE001
            self._dead.add("nvlink")
            return None
        vals = []
        for v in got:
            if getattr(v, "nvmlReturn", 1) != 0:
                self._dead.add("nvlink")  # no NVLink on this device (or no such field)
                return None
            vals.append(float(v.value.ullVal))
        return (vals[0], vals[1]) if len(vals) == 2 else None


def _sum_files(paths: list[str]) -> float | None:
    total = 0
    try:
        for p in paths:
            with open(p) as f:
                total += int(f.read().strip())
    except (OSError, ValueError):
        return None
    return float(total)

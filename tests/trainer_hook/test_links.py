"""Link counters: NIC rates from the real psutil counters, InfiniBand from a fake sysfs
tree (4-byte units), PCIe and NVLink from the fake NVML; absent counters read None."""

from __future__ import annotations

import socket
from pathlib import Path

import psutil
import pytest

from rebalancer_wire.protocol import DeviceSample, ProtocolError
from tests.helpers.nvml import FakeGpu, FakeNvml
from trainer_hook.links import LinkCounters
from trainer_hook.probe import DeviceProbe


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _ib_tree(root: Path, ports: dict[tuple[str, int], tuple[int, int]]) -> None:
    for (dev, port), (xmit, rcv) in ports.items():
        d = root / "class" / "infiniband" / dev / "ports" / str(port) / "counters"
        d.mkdir(parents=True, exist_ok=True)
        (d / "port_xmit_data").write_text(f"{xmit}\n")
        (d / "port_rcv_data").write_text(f"{rcv}\n")


def test_infiniband_counts_4_byte_words_summed_over_ports(tmp_path):
    _ib_tree(tmp_path, {("mlx5_0", 1): (1000, 500), ("mlx5_1", 1): (0, 0)})
    clock = Clock()
    links = LinkCounters(sysfs=str(tmp_path), clock=clock)
    first = links.read()
    assert first.ib_tx is None and first.ib_rx is None  # no interval yet
    _ib_tree(tmp_path, {("mlx5_0", 1): (1000 + 250_000, 500 + 50_000), ("mlx5_1", 1): (250_000, 0)})
    clock.t += 2.0
    r = links.read()
    assert r.ib_tx == pytest.approx(500_000 * 4 / 2.0) and r.ib_rx == pytest.approx(50_000 * 4 / 2.0)
    _ib_tree(tmp_path, {("mlx5_0", 1): (5, 5), ("mlx5_1", 1): (5, 5)})  # counters reset
    clock.t += 1.0
    assert links.read().ib_tx is None


def test_no_infiniband_no_gpu_no_psutil_reads_none(tmp_path):
    r = LinkCounters(sysfs=str(tmp_path)).read()
    assert r.nic_tx is r.ib_tx is r.pcie_tx is r.nvlink_tx is None


def test_pcie_is_read_no_faster_than_every_few_seconds():
    nvml, clock = FakeNvml([FakeGpu()]), Clock()
    links = LinkCounters(nvml=nvml, handle=0, sysfs="/nonexistent", clock=clock, pcie_every_s=5.0)
    r = links.read()
    assert (r.pcie_tx, r.pcie_rx) == (2_000_000 * 1024.0, 1_000_000 * 1024.0)
    for _ in range(4):
        clock.t += 1.0
        links.read()
    assert nvml.calls["nvmlDeviceGetPcieThroughput"] == 2  # tx and rx, once
    clock.t += 1.0
    links.read()
    assert nvml.calls["nvmlDeviceGetPcieThroughput"] == 4
    with pytest.raises(ValueError) as exc:
        LinkCounters(pcie_every_s=0.02)
    assert str(exc.value) == "pcie_every_s must be a number >= 1 (NVML's PCIe read blocks ~20 ms), got 0.02."


def test_nvlink_rates_are_deltas_and_absent_nvlink_is_asked_once():
    gpu = FakeGpu(nvlink_tx_kib=1_000, nvlink_rx_kib=2_000)
    nvml, clock = FakeNvml([gpu, FakeGpu(pcie_tx_kib_s=None, pcie_rx_kib_s=None)]), Clock()
    links = LinkCounters(nvml=nvml, handle=0, sysfs="/nonexistent", clock=clock)
    assert links.read().nvlink_tx is None
    gpu.nvlink_tx_kib, gpu.nvlink_rx_kib = 1_000 + 4_096, 2_000 + 1_024
    clock.t += 4.0
    r = links.read()
    assert r.nvlink_tx == pytest.approx(4_096 * 1024 / 4.0) and r.nvlink_rx == pytest.approx(1024 * 1024 / 4.0)
    no_links = LinkCounters(nvml=nvml, handle=1, sysfs="/nonexistent", clock=clock)
    for _ in range(3):
        clock.t += 6.0
        r = no_links.read()
        assert (r.nvlink_tx, r.pcie_tx, r.pcie_rx) == (None, None, None)
    assert nvml.calls["nvmlDeviceGetFieldValues"] == 2 + 1  # the device without NVLink: asked once


def test_real_nic_counters_see_traffic_we_make():
    # Loopback is left out, so send through the host's own non-loopback address if it has one.
    nics = {n for n, a in psutil.net_if_addrs().items() if n != "lo" and any(x.family == socket.AF_INET for x in a)}
    links = LinkCounters(psutil=psutil, sysfs="/nonexistent")
    first = links.read()
    assert first.nic_tx is None  # no interval yet
    if not nics:
        pytest.skip("no non-loopback interface")
    r = links.read()
    assert r.nic_tx is not None and r.nic_tx >= 0 and r.nic_rx is not None and r.nic_rx >= 0


def test_the_probe_sends_the_rates_and_the_protocol_checks_them(tmp_path):
    _ib_tree(tmp_path, {("mlx5_0", 1): (0, 0)})
    probe = DeviceProbe(nvml=FakeNvml([FakeGpu()]), device_index=0, sysfs=str(tmp_path))
    s = probe.sample_now()
    assert s.pcie_tx_bytes_per_s == 2_000_000 * 1024.0 and s.nvlink_tx_bytes_per_s is None
    back = DeviceSample.from_dict({"t": 1.0, "source": "nvml", "pcie_tx_bytes_per_s": 5e9, "ib_rx_bytes_per_s": None})
    assert back.pcie_tx_bytes_per_s == 5e9 and back.ib_rx_bytes_per_s is None
    with pytest.raises(ProtocolError) as exc:
        DeviceSample.from_dict({"t": 1.0, "source": "nvml", "nic_tx_bytes_per_s": -1})
    assert str(exc.value) == "'nic_tx_bytes_per_s' must be a number between 0 and 10000000000000, got -1.0."



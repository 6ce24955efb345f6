"""NVML through the hook's DeviceProbe against torch.cuda's own figures on the same device."""

from __future__ import annotations

import time

import torch

from tests.gpu._rig import Rig, write_fact
from trainer_hook.probe import DeviceProbe

# nvml.h: NVML_PCIE_UTIL_TX_BYTES / RX_BYTES, NVML_NVLINK_MAX_LINKS, NVML_FEATURE_ENABLED.
PCIE_TX, PCIE_RX = 0, 1
NVLINK_MAX_LINKS = 18


def _probe(rig: Rig) -> DeviceProbe:
    probe = DeviceProbe(device_index=0, nvml=rig.nvml())
    assert probe.source == "nvml", "NVML did not answer for CUDA device 0 (driver or nvidia-ml-py missing)"
    return probe


def test_name_memory_and_clocks_agree_with_torch(rig: Rig) -> None:
    probe = _probe(rig)
    device_type, name, nvml_total = probe.describe()
    block = torch.empty(2**28, dtype=torch.uint8, device=rig.device)  # 256 MiB held by the allocator
    rig.sync()
    if rig.is_cuda:
        torch_total = torch.cuda.get_device_properties(0).total_memory
        reserved = torch.cuda.memory_reserved(0)
    else:  # the fake NVML device stands for a card with 2 GiB, 1 GiB in use
        torch_total, reserved = 2 * 2**30, 2**28
    sample = probe.sample_now()
    del block
    assert name == rig.name()
    assert nvml_total is not None and sample.mem_total_bytes == nvml_total
    # The same card counted twice (CUDA's total may leave out what the driver reserves; which
    # of the two is larger depends on the driver, so only closeness is asserted).
    assert 0.9 * nvml_total <= torch_total <= 1.05 * nvml_total
    # NVML's used memory covers the allocator's reservation and the CUDA context besides.
    assert sample.mem_used_bytes is not None and sample.mem_used_bytes >= reserved
    assert sample.sm_clock_mhz is not None and sample.sm_clock_max_mhz is not None
    assert 0 < sample.sm_clock_mhz <= sample.sm_clock_max_mhz
    assert sample.temp_c is not None and 0 < sample.temp_c < 110
    index, uuid = probe.identity()
    assert index is not None and uuid.startswith("GPU-")
    write_fact("nvml_device", {"device_type": device_type, "name": name, "nvml_total_bytes": nvml_total,
                               "torch_total_bytes": torch_total, "mem_used_bytes": sample.mem_used_bytes,
                               "torch_reserved_bytes": reserved, "sm_clock_mhz": sample.sm_clock_mhz,
                               "sm_clock_max_mhz": sample.sm_clock_max_mhz, "temp_c": sample.temp_c,
                               "throttle_reasons": sample.throttle_reasons, "uuid": uuid})


def test_utilisation_and_power_under_a_busy_kernel(rig: Rig) -> None:
    probe = _probe(rig)
    idle = probe.sample_now()
    # About 1.5 s of queued busy kernels; NVML's utilisation averages over up to one second.
    for _ in range(30):
        rig.busy(50)
    time.sleep(1.0)
    busy = probe.sample_now()  # energy since the idle sample: the mean power of the interval
    rig.sync()
    assert busy.util_pct is not None and busy.util_pct >= 50, (idle.util_pct, busy.util_pct)
    assert busy.power_w is not None and 0 < busy.power_w < 2000
    write_fact("nvml_busy", {"idle_util_pct": idle.util_pct, "busy_util_pct": busy.util_pct,
                             "idle_power_w": idle.power_w, "busy_power_w": busy.power_w,
                             "busy_sm_clock_mhz": busy.sm_clock_mhz})


def test_pcie_throughput_and_nvlink_counters_where_present(rig: Rig) -> None:
    # The probe samples neither (yet); its guarded read shows what this device and driver give:
    # None where NVML has no such counter (the fake has none, so the rehearsal takes that road).
    probe = _probe(rig)
    host = torch.empty(2**28, dtype=torch.uint8).pin_memory() if rig.is_cuda else torch.empty(2**20, dtype=torch.uint8)
    for _ in range(20):  # host-to-device copies while NVML counts (its PCIe window is 20 ms)
        host.to(rig.device, non_blocking=True)
    rx = probe._q("nvmlDeviceGetPcieThroughput", PCIE_RX)
    tx = probe._q("nvmlDeviceGetPcieThroughput", PCIE_TX)
    rig.sync()
    for value in (rx, tx):
        assert value is None or (isinstance(value, int) and value >= 0)  # KB/s
    links = {}
    for link in range(NVLINK_MAX_LINKS):
        state = probe._q("nvmlDeviceGetNvLinkState", link)
        if state is not None:
            links[link] = int(state)
    for state in links.values():
        assert state in (0, 1)
    write_fact("nvml_links", {"pcie_rx_kb_s": rx, "pcie_tx_kb_s": tx, "nvlink_states": links,
                              "nvlink_active": sum(links.values())})

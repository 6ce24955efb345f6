"""DeviceProbe against a fake pynvml (no GPU here) and the real psutil fallback."""

from __future__ import annotations

import os
import threading

import psutil
import pynvml
import pytest

from rebalancer_wire.protocol import DeviceSample, decode, encode
from tests.helpers.nvml import FakeGpu, FakeNvml, NVMLError, NVMLError_GpuIsLost
from tests.helpers.waiting import Collect
from trainer_hook.probe import CLOCK_EVENT_NAMES, DeviceProbe, decode_clock_events, device_type_key


class Clock:
    """Explicit clock: tests move it by hand instead of sleeping."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(gpus: list[FakeGpu] | None = None, **kw: object) -> tuple[DeviceProbe, FakeNvml, Clock]:
    nv = FakeNvml(gpus, old_driver=bool(kw.pop("old_driver", False)))
    clock = Clock()
    probe = DeviceProbe(nvml=nv, device_index=kw.pop("device_index", 0), clock=clock, wall=lambda: 1.7e9, **kw)  # type: ignore[arg-type]
    return probe, nv, clock


def test_nvml_sample_values_and_units() -> None:
    probe, _, _ = make()
    s = probe.sample_now()
    assert s.source == "nvml"
    assert s.t == 1.7e9
    assert s.util_pct == 87.0
    assert s.mem_used_bytes == 30 * 2**30 and s.mem_total_bytes == 80 * 2**30
    assert s.power_w == pytest.approx(512.0)  # first sample: no energy interval yet -> mW / 1000
    assert s.temp_c == 71.0
    assert s.sm_clock_mhz == 1755.0 and s.sm_clock_max_mhz == 1980.0
    assert s.throttle_reasons == []
    assert s.cpu_pct is None and s.rss_bytes is None
    assert probe.latest() is s
    # The sample survives the wire unchanged.
    assert decode(encode_metrics(s)).device == [s]  # type: ignore[union-attr]


def encode_metrics(s: DeviceSample) -> str:
    from rebalancer_wire.protocol import Metrics

    return encode(Metrics(job="j", rank=0, device=[s]))


def test_energy_counter_gives_exact_mean_power() -> None:
    probe, nv, clock = make()
    probe.sample_now()
    gpu = nv.gpus[0]
    gpu.energy_mj += 700_000  # 700 J over 2 s = 350 W, whatever the instantaneous reading says
    gpu.power_mw = 100_000
    clock.t += 2.0
    assert probe.sample_now().power_w == pytest.approx(350.0)
    gpu.energy_mj += 250_000
    clock.t += 0.5
    assert probe.sample_now().power_w == pytest.approx(500.0)


def test_energy_counter_reset_or_missing_falls_back_to_power_usage() -> None:
    probe, nv, clock = make()
    probe.sample_now()
    nv.gpus[0].energy_mj = 5  # counter went backwards (driver reload)
    clock.t += 1.0
    assert probe.sample_now().power_w == pytest.approx(512.0)
    nv.gpus[0].energy_mj = None  # not supported on this board
    clock.t += 1.0
    assert probe.sample_now().power_w == pytest.approx(512.0)
    clock.t += 1.0
    probe.sample_now()
    # "Not supported" is remembered: the driver is not asked again every second.
    assert nv.calls["nvmlDeviceGetTotalEnergyConsumption"] == 3


@pytest.mark.parametrize(
    ("mask", "names"),
    [
        (0, []),
        (0x4, ["sw_power_cap"]),
        (0x8 | 0x40, ["hw_slowdown", "hw_thermal"]),
        (0x20 | 0x80 | 0x1, ["gpu_idle", "sw_thermal", "hw_power_brake"]),
        (0x4 | 0x10000, ["sw_power_cap", "unknown_0x10000"]),
    ],
)
def test_clock_event_decoding(mask: int, names: list[str]) -> None:
    assert decode_clock_events(mask) == names


def test_clock_event_bits_match_real_pynvml() -> None:
    assert CLOCK_EVENT_NAMES[pynvml.nvmlClocksThrottleReasonSwPowerCap] == "sw_power_cap"
    assert CLOCK_EVENT_NAMES[pynvml.nvmlClocksThrottleReasonHwSlowdown] == "hw_slowdown"
    assert CLOCK_EVENT_NAMES[pynvml.nvmlClocksThrottleReasonSwThermalSlowdown] == "sw_thermal"
    assert CLOCK_EVENT_NAMES[pynvml.nvmlClocksThrottleReasonHwThermalSlowdown] == "hw_thermal"
    assert CLOCK_EVENT_NAMES[pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown] == "hw_power_brake"
    assert CLOCK_EVENT_NAMES[pynvml.nvmlClocksThrottleReasonGpuIdle] == "gpu_idle"
    assert CLOCK_EVENT_NAMES[pynvml.nvmlClocksThrottleReasonBoardLimit] == "board_limit"
    assert sum(CLOCK_EVENT_NAMES) == pynvml.nvmlClocksThrottleReasonAll


def test_throttle_reasons_in_sample_new_and_old_driver() -> None:
    for old in (False, True):
        probe, nv, _ = make([FakeGpu(reasons=0x4 | 0x20)], old_driver=old)
        assert probe.sample_now().throttle_reasons == ["sw_power_cap", "sw_thermal"]
        used = "nvmlDeviceGetCurrentClocksThrottleReasons" if old else "nvmlDeviceGetCurrentClocksEventReasons"
        assert nv.calls.get(used) == 1


def test_failing_reads_give_none_not_exceptions() -> None:
    gpu = FakeGpu(fail={
        "nvmlDeviceGetTemperature": NVMLError("Unknown Error"),
        "nvmlDeviceGetUtilizationRates": NVMLError_GpuIsLost("GPU is lost"),
        "nvmlDeviceGetTotalEnergyConsumption": NVMLError("Unknown Error"),
        "nvmlDeviceGetPowerUsage": RuntimeError("anything at all"),
        "nvmlDeviceGetCurrentClocksEventReasons": NVMLError("Unknown Error"),
        "nvmlDeviceGetCurrentClocksThrottleReasons": NVMLError("Unknown Error"),
    })
    probe, nv, _ = make([gpu])
    s = probe.sample_now()
    assert s.temp_c is None and s.util_pct is None and s.power_w is None
    assert s.throttle_reasons == []
    assert s.mem_used_bytes == 30 * 2**30 and s.sm_clock_mhz == 1755.0  # the rest still read
    # A transient failure is retried on the next sample (unlike "not supported").
    gpu.fail.clear()
    assert probe.sample_now().temp_c == 71.0


def test_device_index_and_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [FakeGpu(name="NVIDIA A100-SXM4-40GB", uuid="GPU-a", mem_total=40 * 2**30),
            FakeGpu(name="NVIDIA H100 PCIe", uuid="GPU-b"),
            FakeGpu(name="NVIDIA L40S", uuid="GPU-c", mem_total=48 * 2**30)]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    probe = DeviceProbe(nvml=FakeNvml(gpus))
    assert probe.describe() == ("H100", "NVIDIA H100 PCIe", 80 * 2**30)
    # CUDA index 0 is physical GPU 2 when CUDA_VISIBLE_DEVICES=2,0.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert DeviceProbe(nvml=FakeNvml(gpus), device_index=0).describe()[0] == "L40S"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a")
    assert DeviceProbe(nvml=FakeNvml(gpus), device_index=0).describe() == (
        "A100-40GB", "NVIDIA A100-SXM4-40GB", 40 * 2**30)


def test_identity_is_the_nvml_index_and_uuid_dcgm_labels_use(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b"), FakeGpu(uuid="GPU-c")]
    # CUDA index 0 is physical GPU 2: the labels name the physical one, as DCGM does.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert DeviceProbe(nvml=FakeNvml(gpus), device_index=0).identity() == (2, "GPU-c")
    failing = FakeNvml([FakeGpu(fail={"nvmlDeviceGetUUID": NVMLError("Unknown Error"),
                                      "nvmlDeviceGetIndex": NVMLError("Unknown Error")})])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert DeviceProbe(nvml=failing, device_index=0).identity() == (None, "")
    assert DeviceProbe(use_nvml=False).identity() == (None, "")


def test_missing_device_falls_back_to_psutil() -> None:
    probe = DeviceProbe(nvml=FakeNvml([FakeGpu()]), device_index=5)
    assert probe.source == "psutil"
    assert probe.describe()[0] == "CPU"


def test_device_type_key_is_the_shared_rule_and_keeps_a_name_it_does_not_know() -> None:
    # The names the rule knows: tests/backend/policy/test_devices.py (one table of them).
    assert device_type_key("NVIDIA H100 80GB HBM3") == "H100"
    assert device_type_key("NVIDIA A100-PCIE", 40 * 10**9) == "A100-40GB"
    for name in ("NVIDIA GH200 480GB", " NVIDIA GeForce RTX 4090 ", "NVIDIA L40"):
        assert device_type_key(name) == name.strip()  # the backend can still show it


def test_bytes_name_from_old_pynvml() -> None:
    probe, nv, _ = make()
    nv.gpus[0].name = b"Tesla T4"  # type: ignore[assignment]
    assert probe.describe()[:2] == ("T4", "Tesla T4")


def test_psutil_fallback_sane_values() -> None:
    probe = DeviceProbe(use_nvml=False)
    assert probe.source == "psutil"
    key, name, total = probe.describe()
    assert key == "CPU" and name
    assert total == psutil.virtual_memory().total
    burn = sum(i * i for i in range(200_000))  # some CPU so the percentage has something to show
    assert burn > 0
    s = probe.sample_now()
    assert s.source == "psutil"
    rss = psutil.Process(os.getpid()).memory_info().rss
    assert s.rss_bytes is not None and 0.5 * rss < s.rss_bytes < 2 * rss
    assert s.cpu_pct is not None and s.cpu_pct >= 0
    assert s.util_pct is not None and 0 <= s.util_pct <= 100
    assert s.mem_total_bytes == total
    assert s.mem_used_bytes is not None and 0 < s.mem_used_bytes <= total
    assert s.power_w is None and s.sm_clock_mhz is None and s.throttle_reasons == []
    assert decode(encode_metrics(s)).device == [s]  # type: ignore[union-attr]


def test_sampling_thread_delivers_samples_and_stops() -> None:
    got = Collect(3)
    nv = FakeNvml()
    probe = DeviceProbe(nvml=nv, device_index=0, interval_s=0.01, on_sample=got)
    probe.start()
    probe.start()  # idempotent: still one thread
    assert got.enough.wait(10)
    probe.stop()
    n = len(got)
    assert all(s.source == "nvml" for s in got)
    assert probe.latest() is got[-1]
    assert not any(t.name == "rebalancer-probe" and t.is_alive() for t in threading.enumerate())
    assert len(got) == n  # nothing after stop()


def test_callback_errors_do_not_kill_the_thread() -> None:
    calls = Collect(3)

    def on_sample(s: DeviceSample) -> None:
        calls(s)
        raise RuntimeError("consumer bug")

    probe = DeviceProbe(nvml=FakeNvml(), device_index=0, interval_s=0.01, on_sample=on_sample)
    probe.start()
    try:
        assert calls.enough.wait(10)
    finally:
        probe.stop()


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"interval_s": 0}, "interval_s must be a number > 0, got 0."),
        ({"interval_s": "1"}, "interval_s must be a number > 0, got '1'."),
        ({"device_index": -1}, "device_index must be an integer >= 0 or None, got -1."),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], text: str) -> None:
    with pytest.raises(ValueError) as exc:
        DeviceProbe(use_nvml=False, **kwargs)  # type: ignore[arg-type]
    assert str(exc.value) == text


def test_accelerator_without_nvml_is_described_through_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    # A ROCm build reports AMD GPUs through torch.cuda; NVML does not see them. No such GPU
    # here, so torch.cuda's answers are faked; the mapping and the fallback are real.
    import torch

    props = type("Props", (), {"name": "AMD Instinct MI300X", "total_memory": 192 * 2**30})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props if i == 1 else None)
    probe = DeviceProbe(use_nvml=False, device_index=1)
    assert probe.describe() == ("MI300X", "AMD Instinct MI300X", 192 * 2**30)
    assert probe.sample_now().source == "psutil"
    # Without an explicit device and with CUDA never initialised, the rank is a CPU rank.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert DeviceProbe(use_nvml=False).describe()[0] == "CPU"


def test_intel_xpu_and_apple_mps_ranks_are_named_as_such_not_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 10. No XPU or MPS here, so torch's answers are faked; the choice of device and
    # the naming rule (rebalancer_wire.devices, which the policy uses too) are real.
    import torch

    from backend.policy import normalize_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "is_initialized", lambda: False)
    assert DeviceProbe(use_nvml=False).describe()[0] == "CPU", "an XPU this process never used"

    name = "Intel(R) Data Center GPU Max 1550"
    props = type("Props", (), {"name": name, "total_memory": 128 * 10**9})()
    monkeypatch.setattr(torch.xpu, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.xpu, "current_device", lambda: 2)
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda i: props if i == 2 else None)
    key, got_name, total = DeviceProbe(use_nvml=False).describe()
    assert (key, got_name, total) == (name, name, 128 * 10**9)
    assert normalize_device(got_name, total) is None, "no datasheet row: the static split weighs it evenly"

    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: 0)
    assert DeviceProbe(use_nvml=False).describe()[0] == "CPU", "MPS present but unused"
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: 4096)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 48 * 2**30)
    assert DeviceProbe(use_nvml=False).describe() == ("Apple MPS", "Apple MPS", 48 * 2**30)

"""``import pynvml`` for a torchrun job on a machine with no GPU: put this directory first on
the workers' PYTHONPATH and each rank's DeviceProbe reads one of two fake GPUs (by
LOCAL_RANK) through the real probe code. Values: tests/helpers/nvml.py."""

from __future__ import annotations

from typing import Any

from tests.helpers.nvml import (
    NVML_CLOCK_SM,
    NVML_TEMPERATURE_GPU,
    FakeGpu,
    FakeNvml,
    NVMLError,
    NVMLError_NotSupported,
)

__all__ = ["NVML_CLOCK_SM", "NVML_TEMPERATURE_GPU", "NVMLError", "NVMLError_NotSupported", "GPUS"]

GPUS = [
    FakeGpu(name="NVIDIA H100 80GB HBM3", uuid="GPU-11111111-1111-1111-1111-111111111111"),
    FakeGpu(name="NVIDIA A100-SXM4-40GB", uuid="GPU-22222222-2222-2222-2222-222222222222",
            mem_total=40 * 2**30, util_gpu=99, temp_c=83, sm_clock=1200, reasons=0x20 | 0x4),
]
_nvml = FakeNvml(GPUS)


def __getattr__(name: str) -> Any:
    return getattr(_nvml, name)

"""Device table and workload profiles: how much work a device type deserves before any
measurement exists (the ``static`` strategy)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rebalancer_wire.devices import SLOWDOWN_REASONS, device_key

__all__ = [
    "DeviceSpec",
    "DEVICE_TABLE",
    "WORKLOAD_PROFILES",
    "SLOWDOWN_REASONS",
    "normalize_device",
    "device_weights",
]

log = logging.getLogger(__name__)
_LOGGED: set[str] = set()


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """Vendor datasheet figures of one device type (dense, no sparsity)."""

    name: str
    vendor: str
    tflops_bf16: float  # dense bf16 (fp16 where the part has no bf16) tensor TFLOP/s
    mem_bw_gbs: float  # memory bandwidth, GB/s
    mem_bytes: int  # device memory


_GB = 10**9

# Datasheet values: NVIDIA H200/H100 SXM, A100 (SXM, 40 and 80 GB), L40S, L4, A10 (the A10G
# is AWS's A10 variant; NVIDIA publishes no separate sheet), V100 SXM2 32 GB (fp16, no bf16),
# T4 (fp16), AMD Instinct MI300X and MI250X (OAM). CPU is a nominal server socket, kept so a
# CPU rank gets a small but non-zero share.
DEVICE_TABLE: dict[str, DeviceSpec] = {
    s.name: s
    for s in (
        DeviceSpec("H200", "NVIDIA", 989.0, 4800.0, 141 * _GB),
        DeviceSpec("H100", "NVIDIA", 989.0, 3350.0, 80 * _GB),
        DeviceSpec("A100-80GB", "NVIDIA", 312.0, 2039.0, 80 * _GB),
        DeviceSpec("A100-40GB", "NVIDIA", 312.0, 1555.0, 40 * _GB),
        DeviceSpec("L40S", "NVIDIA", 362.0, 864.0, 48 * _GB),
        DeviceSpec("L4", "NVIDIA", 121.0, 300.0, 24 * _GB),
        DeviceSpec("A10G", "NVIDIA", 125.0, 600.0, 24 * _GB),
        DeviceSpec("V100", "NVIDIA", 125.0, 900.0, 32 * _GB),
        DeviceSpec("T4", "NVIDIA", 65.0, 320.0, 16 * _GB),
        DeviceSpec("MI300X", "AMD", 1307.4, 5300.0, 192 * _GB),
        DeviceSpec("MI250X", "AMD", 383.0, 3276.8, 128 * _GB),
        DeviceSpec("CPU", "generic", 2.0, 200.0, 256 * _GB),
    )
}

# (compute weight, bandwidth weight): the exponents of a weighted geometric mean of TFLOP/s
# and GB/s. Large-model training is mostly matmul-bound; recommendation models spend their
# time in embedding lookups, which are bandwidth-bound.
WORKLOAD_PROFILES: dict[str, tuple[float, float]] = {
    "llm": (0.8, 0.2),
    "vision": (0.7, 0.3),
    "diffusion": (0.85, 0.15),
    "recsys": (0.2, 0.8),
}


def normalize_device(name: str | None, mem_total_bytes: int | None = None) -> str | None:
    """Map a driver's device name to a key of :data:`DEVICE_TABLE`; unknown gives ``None``.

    The rule is the hook's (``rebalancer_wire.devices.device_key``), so the policy and the
    ranks' probes always name a device alike:

    >>> normalize_device("NVIDIA H100 80GB HBM3")
    'H100'
    >>> normalize_device("NVIDIA A100-SXM4-40GB")
    'A100-40GB'
    """
    return device_key(name, mem_total_bytes)


def device_weights(
    device_types: Sequence[str | None],
    workload: str = "llm",
    custom_weights: Mapping[str, float] | None = None,
) -> tuple[tuple[float, ...], list[str]]:
    """Relative work per rank for a workload, and warnings for what the table lacked.

    ``workload`` is a key of :data:`WORKLOAD_PROFILES` or ``"custom"``. With ``"custom"``,
    ``custom_weights`` either maps device types to weights (``{"H100": 3, "A100-80GB": 1}``)
    or gives a profile (``{"compute": 0.5, "bandwidth": 0.5}``). If any rank's device is
    unknown, every rank gets the same weight: mixing a guess with datasheet figures could
    starve or swamp the unknown card, and measurement will correct the split anyway.
    """
    warnings: list[str] = []
    profile: tuple[float, float] | None = None
    per_device: dict[str, float] | None = None
    if workload == "custom":
        if not custom_weights:
            raise ValueError(
                "workload 'custom' needs custom_weights: a map of device type to weight, "
                "or {'compute': x, 'bandwidth': y}."
            )
        if set(custom_weights) <= {"compute", "bandwidth"}:
            profile = (
                float(custom_weights.get("compute", 0.0)),
                float(custom_weights.get("bandwidth", 0.0)),
            )
            if profile[0] < 0 or profile[1] < 0 or sum(profile) <= 0:
                raise ValueError(
                    f"custom profile weights must be >= 0 and not both 0, got {dict(custom_weights)}."
                )
        else:
            per_device = {}
            for name, value in custom_weights.items():
                if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                    raise ValueError(
                        f"custom weight for {name!r} must be a positive number, got {value!r}."
                    )
                per_device[normalize_device(name) or name] = float(value)
    elif workload in WORKLOAD_PROFILES:
        profile = WORKLOAD_PROFILES[workload]
    else:
        raise ValueError(
            f"unknown workload {workload!r}; expected one of "
            f"{sorted(WORKLOAD_PROFILES) + ['custom']}."
        )

    weights: list[float | None] = []
    unknown: list[int] = []
    for rank, raw in enumerate(device_types):
        key: str | None = normalize_device(raw) if raw is not None else None
        w: float | None = None
        if per_device is not None:
            w = per_device.get(key) if key is not None else per_device.get(raw or "")
        elif key is not None and profile is not None:
            spec = DEVICE_TABLE[key]
            w = spec.tflops_bf16 ** profile[0] * spec.mem_bw_gbs ** profile[1]
        if w is None:
            unknown.append(rank)
        weights.append(w)
    if unknown:
        names = sorted({str(device_types[r]) for r in unknown})
        msg = (
            f"unknown device type {', '.join(names)} on rank(s) "
            f"{', '.join(map(str, unknown))}; using equal weights for all ranks"
        )
        if msg not in _LOGGED:  # the policy runs every few seconds: say it once
            _LOGGED.add(msg)
            log.warning(msg)
        warnings.append(msg)
        return tuple(1.0 for _ in device_types), warnings
    return tuple(float(w) for w in weights if w is not None), warnings

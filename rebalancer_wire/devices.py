"""One rule for device identity: a driver's device name (and memory) -> the device table's key.

The hook's probe names its device with it (``hello.device_type``), and the backend's policy
maps names to its datasheet table with it, so both always agree. Standard library only:
the backend imports it without torch.
"""

from __future__ import annotations

import re

__all__ = ["CLOCK_EVENT_NAMES", "DEVICE_KEYS", "SLOWDOWN_REASONS", "device_key"]

# NVML's clock-event (throttle) reasons: bit -> name. Every reason the probe reports.
CLOCK_EVENT_NAMES: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
    0x200: "board_limit",
    0x400: "reliability",
}
# The reasons among them that mean the card is slowed by heat or power: the policy's
# sign of a throttling device (the others are idle, application or sync clocks).
SLOWDOWN_REASONS: frozenset[str] = frozenset(
    {"sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"}
)

# The keys of the backend's device table (backend/policy/devices.py holds their datasheets).
DEVICE_KEYS = (
    "H200", "H100", "A100-80GB", "A100-40GB", "L40S", "L4", "A10G", "V100", "T4", "MI300X",
    "MI250X", "CPU",
)
_GB = 10**9

# Checked in order. "A10G?" takes the A10 too: the A10G is AWS's A10 variant (one sheet).
_PATTERNS: tuple[tuple[str, str], ...] = (
    ("H200", r"H200"),
    ("H100", r"H100"),
    ("A100", r"A100"),
    ("L40S", r"L40S"),
    ("L4", r"L4"),
    ("A10G", r"A10G?"),
    ("V100", r"V100"),
    ("T4", r"T4"),
    ("MI300X", r"MI300X?"),
    ("MI250X", r"MI250X?"),
    ("CPU", r"CPU"),
)


def device_key(name: str | None, mem_total_bytes: int | None = None) -> str | None:
    """The device table's key for a device name, or None when it names no known type.

    >>> device_key("NVIDIA H100 80GB HBM3")
    'H100'
    >>> device_key("NVIDIA A100-SXM4-40GB")
    'A100-40GB'

    An A100 whose name does not give its size is told apart by ``mem_total_bytes`` (below
    60 GB: the 40 GB part); with the memory unknown it is the 80 GB part, the more common
    one today.
    """
    if not name or not isinstance(name, str):
        return None
    upper = name.strip().upper()
    if upper in ("CPU", "PSUTIL") or upper.startswith("CPU"):
        return "CPU"
    for key in DEVICE_KEYS:  # already a key, any case
        if upper == key.upper():
            return key
    for key, pattern in _PATTERNS:
        # Whole tokens only: "L4" must not match "L40S", "A10" must not match "A100".
        if re.search(rf"(?<![A-Z0-9]){pattern}(?![A-Z0-9])", upper):
            if key != "A100":
                return key
            if "40G" in upper:
                return "A100-40GB"
            if "80G" in upper:
                return "A100-80GB"
            if mem_total_bytes is not None and mem_total_bytes < 60 * _GB:
                return "A100-40GB"
            return "A100-80GB"
    return None

"""Issue 10: one device-identity rule, used by the hook's probe and the backend's policy."""

from __future__ import annotations

import pytest

from backend.policy import DEVICE_TABLE, normalize_device
from rebalancer_wire.devices import DEVICE_KEYS, device_key
from trainer_hook.probe import device_type_key

NAMES = [
    ("NVIDIA A100-PCIE", None),  # no size in the name, memory unknown: they disagreed (40 vs 80 GB)
    ("NVIDIA A100-PCIE", 40 * 10**9),
    ("NVIDIA A100-PCIE", 42_000_000_000),
    ("NVIDIA A100-PCIE", 80 * 10**9),
    ("NVIDIA A100-SXM4-40GB", None),
    ("NVIDIA A100 80GB PCIe", None),
    ("NVIDIA H100 80GB HBM3", None),
    ("NVIDIA GH200 480GB", None),
    ("NVIDIA A10", None),
    ("NVIDIA L40", None),
    ("AMD Instinct MI300X", None),
    ("cpu", None),
]


@pytest.mark.parametrize(("name", "mem"), NAMES)
def test_the_hook_and_the_policy_name_a_device_the_same_way(name: str, mem: int | None) -> None:
    key = device_key(name, mem)
    assert normalize_device(name, mem) == key
    assert device_type_key(name, mem) == (key or name.strip())


def test_an_a100_of_unknown_size_is_the_80gb_part_and_memory_decides_otherwise() -> None:
    assert device_key("NVIDIA A100-PCIE") == "A100-80GB"
    assert device_key("NVIDIA A100-PCIE", 40 * 2**30) == "A100-40GB"
    assert device_key("NVIDIA A100-PCIE", 80 * 2**30) == "A100-80GB"


def test_every_key_has_a_datasheet_row() -> None:
    assert set(DEVICE_KEYS) == set(DEVICE_TABLE)

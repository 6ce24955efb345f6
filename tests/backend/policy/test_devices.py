"""Device table, name normalisation and workload weights."""

from __future__ import annotations

import logging

import pytest

from backend.policy import DEVICE_TABLE, device_weights, normalize_device, static_shares
from backend.policy.devices import _LOGGED

REQUIRED = ["H200", "H100", "A100-40GB", "A100-80GB", "L40S", "L4", "A10G", "V100", "T4",
            "MI300X", "MI250X", "CPU"]


def test_table_has_every_required_device_with_positive_specs():
    for key in REQUIRED:
        spec = DEVICE_TABLE[key]
        assert spec.tflops_bf16 > 0 and spec.mem_bw_gbs > 0 and spec.mem_bytes > 0


@pytest.mark.parametrize(
    ("name", "mem", "key"),
    [
        ("NVIDIA H200", None, "H200"),
        ("NVIDIA H100 80GB HBM3", None, "H100"),
        ("NVIDIA H100 PCIe", None, "H100"),
        ("NVIDIA A100-SXM4-80GB", None, "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", None, "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", None, "A100-40GB"),
        ("NVIDIA L40S", None, "L40S"),
        ("NVIDIA L40", None, None),
        ("NVIDIA L4", None, "L4"),
        ("NVIDIA A10G", None, "A10G"),
        ("NVIDIA A10", None, "A10G"),  # one rule with the hook: the A10G is AWS's A10
        ("Tesla V100-SXM2-32GB", None, "V100"),
        ("Tesla V100-SXM2-16GB", None, "V100"),
        ("Tesla T4", None, "T4"),
        ("AMD Instinct MI300X", None, "MI300X"),
        ("AMD Instinct MI250X", None, "MI250X"),
        ("cpu", None, "CPU"),
        ("a100-80gb", None, "A100-80GB"),
        ("NVIDIA GH200 480GB", None, None),
        ("NVIDIA GeForce RTX 4090", None, None),
        (None, None, None),
        ("", None, None),
        # No size in the name: the memory decides.
        ("NVIDIA A100-PCIE", 40 * 2**30, "A100-40GB"),
        ("NVIDIA A100-PCIE", 40 * 10**9, "A100-40GB"),
        ("NVIDIA A100-PCIE", 80 * 10**9, "A100-80GB"),
    ],
)
def test_normalize_device(name, mem, key):
    # The one table of device names: the hook's probe names devices by the same rule.
    assert normalize_device(name, mem) == key


def test_llm_weights_give_h100_more_than_a100():
    shares = static_shares(["H100", "H100", "A100-80GB", "A100-80GB"], 256, "llm")
    assert sum(shares) == 256
    assert shares[0] > shares[2] and shares[1] > shares[3]
    assert shares[0] == shares[1] and shares[2] == shares[3]


def test_recsys_weighs_bandwidth_more_than_llm():
    # H200 and H100 have the same TFLOP/s; only bandwidth tells them apart.
    llm, _ = device_weights(["H200", "H100"], "llm")
    recsys, _ = device_weights(["H200", "H100"], "recsys")
    assert recsys[0] / recsys[1] > llm[0] / llm[1] > 1.0


def test_custom_weights_by_device_and_by_profile():
    w, _ = device_weights(["H100", "T4"], "custom", {"H100": 3.0, "T4": 1.0})
    assert w == (3.0, 1.0)
    w, _ = device_weights(["H100", "T4"], "custom", {"compute": 1.0, "bandwidth": 0.0})
    assert w[0] / w[1] == pytest.approx(989.0 / 65.0)
    with pytest.raises(ValueError, match="must be a positive number, got -1"):
        device_weights(["H100"], "custom", {"H100": -1})
    with pytest.raises(ValueError, match="workload 'custom' needs custom_weights"):
        device_weights(["H100"], "custom", None)
    with pytest.raises(ValueError, match="unknown workload 'nlp'"):
        device_weights(["H100"], "nlp")


def test_unknown_device_falls_back_to_equal_weights_with_a_logged_warning(caplog):
    _LOGGED.discard("unknown device type Mystery X9 on rank(s) 1; using equal weights for all ranks")
    with caplog.at_level(logging.WARNING, logger="backend.policy.devices"):
        weights, warnings = device_weights(["H100", "Mystery X9"], "llm")
        device_weights(["H100", "Mystery X9"], "llm")
    assert weights == (1.0, 1.0)
    assert warnings == ["unknown device type Mystery X9 on rank(s) 1; using equal weights "
                        "for all ranks"]
    assert caplog.text.count(warnings[0]) == 1  # logged once, returned every time
    assert static_shares(["H100", None], 10) == (5, 5)

"""Real torchrun jobs on the device: examples/ddp_train.py as written (NCCL, world size 1),
and the exactness job on NCCL at world size 1 and on two ranks sharing one GPU over gloo
with CUDA tensors, each exact to the single-process replay of tests/trainer_hook. In the
rehearsal the same jobs run on CPU over gloo."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from tests.gpu._rig import Rig, write_fact
from tests.helpers.torchrun import run_torchrun
from tests.trainer_hook.test_exactness import _reference_params

pytestmark = pytest.mark.multiproc
WORKER = "tests/gpu/_ddp_worker.py"
STEPS = 20
PLAN = "2=8,4;9=3,9"  # two placement changes on two ranks (one on one rank: ignored there)
SLOW_MS = 30.0


def _job(tmp_path: Path, nproc: int, *args: str) -> list[dict]:
    run_torchrun(nproc, [WORKER, "--out", str(tmp_path), "--steps", str(STEPS), *args], timeout=150)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


def _assert_exact(rank0: dict) -> None:
    got = [torch.tensor(p, dtype=torch.float64) for p in rank0["params"]]
    for g, r in zip(got, _reference_params(STEPS), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)


def test_ddp_example_as_written_on_nccl_at_world_size_1(rig: Rig) -> None:
    done = run_torchrun(1, ["examples/ddp_train.py", "--epochs", "2"], timeout=150)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("epoch ")]
    assert [ln.split(":")[0] for ln in lines] == ["epoch 0", "epoch 1"], done.stdout
    assert "batch 32," in lines[1] and "shares [256]" in lines[1], lines
    write_fact("ddp_example", {"device": rig.kind, "stdout": lines})


def test_nccl_world_size_1_is_exact_to_the_replay(rig: Rig, tmp_path: Path) -> None:
    (r0,) = _job(tmp_path, 1, "--backend", "nccl")
    assert r0["backend"] == ("nccl" if rig.is_cuda else "gloo") and r0["gradients"] == "ddp_comm_hook"
    assert r0["events"] is not None, "the hook took host timestamps on the device"
    _assert_exact(r0)


def test_two_ranks_sharing_one_gpu_over_gloo_are_exact_and_time_the_slow_rank(rig: Rig, tmp_path: Path) -> None:
    ranks = _job(tmp_path, 2, "--backend", "gloo", "--share-gpu", "--plan", PLAN,
                 "--slow-rank", "1", "--slow-ms", str(SLOW_MS))
    assert {r["device"] for r in ranks} == {"cuda:0" if rig.is_cuda else "cpu"}
    assert all(r["events"] is not None for r in ranks), [r["events"] for r in ranks]
    assert ranks[0]["timeline"] == ranks[1]["timeline"]
    assert len(ranks[0]["timeline"]) >= 2, ranks[0]["timeline"]  # at least one plan placement applied
    _assert_exact(ranks[0])
    # Rank 1's forward holds SLOW_MS more on the device; rank 0 waits for it in sync.
    fast_sync = statistics.median(ranks[0]["sync_wait_ms"][3:])
    slow_sync = statistics.median(ranks[1]["sync_wait_ms"][3:])
    slow_compute = statistics.median(ranks[1]["compute_ms"][3:])
    write_fact("ddp_two_ranks_one_gpu", {"device": rig.kind, "slow_ms": SLOW_MS,
                                         "sync_wait_ms_median": [fast_sync, slow_sync],
                                         "compute_ms_median": [statistics.median(ranks[0]["compute_ms"][3:]),
                                                               slow_compute],
                                         "timeline": ranks[0]["timeline"]})
    assert slow_compute >= 0.9 * SLOW_MS, slow_compute
    assert fast_sync > slow_sync, (fast_sync, slow_sync)

"""Issue 24 (safety slice): a device-mesh job the hook cannot balance is refused at attach.

Without ``dp_mesh`` the hook makes every rank of the world its own data-parallel worker. A
DP2 x TP2 job (torchtitan's layout) used to train silently wrong: both ranks of a TP group
got different samples. One real torchrun job of 4 gloo ranks builds every scenario in
turn (tests/trainer_hook/_mesh_worker.py) and writes what attach() said."""

from __future__ import annotations

import json

import pytest

from tests.helpers.torchrun import run_torchrun

WORLD = 4
DP_MESH = "need RebalanceHook(..., dp_mesh=mesh['dp']) (the whole 2-D mesh for HSDP), which makes shares per data-parallel replica"


@pytest.fixture(scope="module")
def said(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    out = tmp_path_factory.mktemp("mesh")
    run_torchrun(WORLD, ["tests/trainer_hook/_mesh_worker.py", str(out)], timeout=150)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.multiproc
@pytest.mark.parametrize("gradients", ["auto", "loss_scale"])
def test_fsdp2_with_tensor_parallelism_is_refused_naming_dp_mesh(said: list[dict[str, str]], gradients: str) -> None:
    scenario = "dp2_tp2_fsdp2" + ("_loss_scale" if gradients == "loss_scale" else "")
    for rank in range(WORLD):
        text = said[rank][scenario]
        assert text.startswith(
            "REFUSED Rebalancer balances data-parallel ranks only: parameter '0.weight' is a DTensor "
            "over mesh dims ('dp', 'tp') with placements ("
        ), text
        assert "mesh dim 'tp' (2 ranks) is not data parallel" in text, text
        assert "Shard(dim=0)" in text, text
        assert DP_MESH in text, text


@pytest.mark.multiproc
def test_fsdp2_over_a_dp_sub_mesh_is_refused(said: list[dict[str, str]]) -> None:
    for rank in range(WORLD):
        text = said[rank]["fsdp2_dp_submesh"]
        assert text.startswith(
            "REFUSED Rebalancer balances data-parallel ranks only: FSDP2 (fully_shard) reduces "
            "gradients over 2 of the 4 ranks (mesh dims ('dp',))"
        ), text
        assert DP_MESH in text, text


@pytest.mark.multiproc
@pytest.mark.parametrize("gradients", ["auto", "loss_scale"])
def test_ddp_over_a_sub_group_is_refused(said: list[dict[str, str]], gradients: str) -> None:
    scenario = "ddp_subgroup" + ("_loss_scale" if gradients == "loss_scale" else "")
    for rank in range(WORLD):
        text = said[rank][scenario]
        assert text.startswith(
            "REFUSED Rebalancer balances data-parallel ranks only: DistributedDataParallel reduces "
            "gradients over a process group of 2 of the 4 ranks"
        ), text
        assert DP_MESH in text, text


@pytest.mark.multiproc
def test_data_parallel_over_the_whole_world_still_attaches(said: list[dict[str, str]]) -> None:
    for rank in range(WORLD):
        assert said[rank]["fsdp2_world"] == "ATTACHED fsdp2_reduce_scatter"
        assert said[rank]["ddp_world"] == "ATTACHED ddp_comm_hook"

"""Issue 24: RebalanceHook(..., dp_mesh=M) balances the data-parallel replicas of a mesh job.

One real torchrun job of 4 gloo ranks (tests/trainer_hook/_dp_mesh_worker.py) runs every
case in turn: DP2 x TP2 (FSDP2 over mesh['dp'] + Colwise/Rowwise over 'tp'), HSDP 2 x 2 and
DP2 x TP2 with the token-mean loss and DDP over the 'dp' sub-group, each under three pushed placements; the parameters
must equal a single-process replay of the same global batches (float64, 1e-9). In the DDP case one
member of a replica is slowed: the replica's leader must report the slow member's pace. The same
launch first attaches the hook, without dp_mesh, to the mesh set-ups it must refuse (at the end)."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from tests.helpers.torchrun import run_torchrun
from tests.trainer_hook import _exact_worker as w
from tests.trainer_hook._dp_mesh_worker import PLANS, SLOW_CASE, SLOW_MS, STEPS, tokens
from trainer_hook.placement import PlacementSchedule
from trainer_hook.sampler import RebalanceBatchSampler

WORLD = 4
REPLICAS = {"dp2_tp2": [0, 0, 1, 1], "hsdp": [0, 1, 2, 3], "dp2_tp2_tokens": [0, 0, 1, 1], "dp2_ddp": [0, 0, 1, 1]}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("dp_mesh")
    run_torchrun(WORLD, ["tests/trainer_hook/_dp_mesh_worker.py", str(out)], timeout=240)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _reference(case: str) -> list[torch.Tensor]:
    """One process training on each whole global batch, the job's loss over it."""
    ds = w.IndexedData()
    order = RebalanceBatchSampler(ds, schedule=PlacementSchedule(1, w.GLOBAL_BATCH), rank=0, shuffle=True, seed=3)
    model = w.build_model()
    opt = w.make_optimizer(model)
    for k in range(STEPS):
        idx = torch.tensor(order.global_batch(k))
        x, y = ds.x[idx], ds.y[idx]
        if case.endswith("_tokens"):  # the mean over the valid tokens of the global batch
            n = tokens(idx)
            ((n * (model(x) - y).squeeze(1).pow(2)).sum() / n.sum()).backward()
        else:
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in model.parameters()]


@pytest.mark.multiproc
@pytest.mark.parametrize("case", list(PLANS))
def test_mesh_job_under_changing_placements_gives_the_single_process_parameters(ranks: list[dict], case: str) -> None:
    got = [r[case] for r in ranks]
    assert [g["replica"] for g in got] == REPLICAS[case]
    assert {g["replicas"] for g in got} == {max(REPLICAS[case]) + 1}
    assert got[0]["gradients"] == ("ddp_comm_hook" if case.endswith("_ddp") else "fsdp2_reduce_scatter")
    # All three pushed placements took effect, per replica.
    assert got[0]["shares"][1:] == list(PLANS[case].values())
    order = RebalanceBatchSampler(w.N_SAMPLES, schedule=PlacementSchedule(1, w.GLOBAL_BATCH), rank=0, seed=3)
    for k in range(STEPS):
        by_replica: dict[int, list[int]] = {}
        for g in got:  # every member of a replica trained the identical local batch
            assert by_replica.setdefault(g["replica"], g["seen"][k]) == g["seen"][k], (case, k)
        trained = sorted(i for seen in by_replica.values() for i in seen)
        assert trained == sorted(order.global_batch(k)), (case, k)
    for want, have in zip(_reference(case), got[0]["params"], strict=True):
        torch.testing.assert_close(torch.tensor(have, dtype=torch.float64), want, rtol=0, atol=1e-9)


@pytest.mark.multiproc
def test_a_wrong_dp_mesh_or_placement_gets_a_clear_error(ranks: list[dict]) -> None:
    for rank in range(WORLD):
        said = ranks[rank]["disagree"]
        assert said.startswith("REFUSED FSDP2 (fully_shard) reduces gradients over mesh ('dp',) (ranks "), said
        assert "but dp_mesh ('tp',) holds ranks" in said and "the model's mesh and dp_mesh must agree" in said
        assert ranks[rank]["outside"] == (
            "REFUSED dp_mesh is not a sub-mesh of the world: ranks [2, 3] of the 4 are not in the dp_mesh "
            "they passed (('dp',), ranks [0, 1] here); every rank must pass its own data-parallel slice "
            "of one world mesh, e.g. mesh['dp']."
        )
    assert ranks[0]["per_rank_shares"] == (
        "placement version 1 is invalid: it has one share per rank (4), but with dp_mesh shares are per "
        "data-parallel replica: this job has 2 replicas of 2 ranks each; give 2 shares."
    )


@pytest.mark.multiproc
def test_members_of_a_replica_that_train_different_samples_stop_with_a_clear_error(ranks: list[dict]) -> None:
    # Each replica's two members built their samplers with different seeds: the first
    # window's fingerprints disagree at batch 0, every rank raises at the same batch (16: the
    # hand-over after the one that carried it), and the job ends instead of training wrong.
    for rank in range(WORLD):
        got = ranks[rank]["seed_mismatch"]
        assert got["at"] == 16, got
        assert got["said"].startswith(
            f"the members of one data-parallel replica (ranks {[0, 1] if rank < 2 else [2, 3]}) trained "
            "different samples at batch 0: every rank of a replica"), got


@pytest.mark.multiproc
def test_a_replica_reports_the_pace_of_its_slowest_member(ranks: list[dict]) -> None:
    # Rank 1 sleeps in every forward; its replica's leader (rank 0) shares no collective with
    # it in this case (DDP reduces over 'dp': ranks 0 and 2, 1 and 3), so only the combined
    # records can carry the slow member's time.
    reported = {k: compute for k, compute, _, _ in ranks[0][SLOW_CASE]["steps"]}
    own = {k: compute for k, compute, _, _ in ranks[1][SLOW_CASE]["steps"]}
    assert sorted(reported) == list(range(STEPS)), "every step reported once, the last window at close"
    assert sorted(own) == list(range(STEPS))
    for k in range(STEPS):
        assert reported[k] >= own[k], (k, reported[k], own[k])  # the max over the members
        assert reported[k] >= SLOW_MS, (k, reported[k])  # the sleep alone lasts that long
    # ... and names the member whose time that is: rank 1 on every step.
    assert ranks[0][SLOW_CASE]["slowest"] == [1] * STEPS
    assert [r[SLOW_CASE]["replica_ranks"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    host = socket.gethostname()  # each member's device as the leader's hello lists it (CPU ranks here)
    assert [r[SLOW_CASE]["replica_devices"] for r in ranks] == [[f"{host} CPU"] * 2] * 4
    # HSDP's replicas are single ranks: nothing to combine, each reports its own.
    assert sorted(k for k, *_ in ranks[1]["hsdp"]["steps"]) == list(range(STEPS))
    assert ranks[1]["hsdp"]["slowest"] == [None] * STEPS and ranks[1]["hsdp"]["replica_ranks"] == [1]


@pytest.mark.multiproc
def test_the_hello_says_the_mesh_shape(ranks: list[dict]) -> None:
    dp_tp = {"dp": 2, "replica_size": 2, "dims": ["dp", "tp"], "shape": [2, 2]}
    assert ranks[0]["dp2_tp2"]["mesh"] == dp_tp and ranks[0]["dp2_tp2"]["mesh_label"] == "DP 2 x TP 2"
    assert ranks[0]["dp2_ddp"]["mesh"] == dp_tp
    assert ranks[0]["hsdp"]["mesh"] == {"dp": 4, "replica_size": 1, "dims": ["dp_replicate", "dp_shard"],
                                        "shape": [2, 2]}
    assert ranks[0]["hsdp"]["mesh_label"] == "DP_REPLICATE 2 x DP_SHARD 2"


# Issue 24 (safety slice): a device-mesh job the hook cannot balance is refused at attach.
# Without dp_mesh the hook makes every rank of the world its own data-parallel worker. A
# DP2 x TP2 job (torchtitan's layout) used to train silently wrong: both ranks of a TP group
# got different samples. The same launch builds every such scenario in turn
# (tests/trainer_hook/_mesh_worker.py) and records what attach() said.
DP_MESH = "need RebalanceHook(..., dp_mesh=mesh['dp']) (the whole 2-D mesh for HSDP), which makes shares per data-parallel replica"


@pytest.mark.multiproc
@pytest.mark.parametrize("gradients", ["auto", "loss_scale"])
def test_fsdp2_with_tensor_parallelism_is_refused_naming_dp_mesh(ranks: list[dict], gradients: str) -> None:
    scenario = "dp2_tp2_fsdp2" + ("_loss_scale" if gradients == "loss_scale" else "")
    for rank in range(WORLD):
        text = ranks[rank]["attach"][scenario]
        assert text.startswith(
            "REFUSED Rebalancer balances data-parallel ranks only: parameter '0.weight' is a DTensor "
            "over mesh dims ('dp', 'tp') with placements ("
        ), text
        assert "mesh dim 'tp' (2 ranks) is not data parallel" in text, text
        assert "Shard(dim=0)" in text, text
        assert DP_MESH in text, text


@pytest.mark.multiproc
def test_fsdp2_over_a_dp_sub_mesh_is_refused(ranks: list[dict]) -> None:
    for rank in range(WORLD):
        text = ranks[rank]["attach"]["fsdp2_dp_submesh"]
        assert text.startswith(
            "REFUSED Rebalancer balances data-parallel ranks only: FSDP2 (fully_shard) reduces "
            "gradients over 2 of the 4 ranks (mesh dims ('dp',))"
        ), text
        assert DP_MESH in text, text


@pytest.mark.multiproc
@pytest.mark.parametrize("gradients", ["auto", "loss_scale"])
def test_ddp_over_a_sub_group_is_refused(ranks: list[dict], gradients: str) -> None:
    scenario = "ddp_subgroup" + ("_loss_scale" if gradients == "loss_scale" else "")
    for rank in range(WORLD):
        text = ranks[rank]["attach"][scenario]
        assert text.startswith(
            "REFUSED Rebalancer balances data-parallel ranks only: DistributedDataParallel reduces "
            "gradients over a process group of 2 of the 4 ranks"
        ), text
        assert DP_MESH in text, text


@pytest.mark.multiproc
def test_data_parallel_over_the_whole_world_still_attaches(ranks: list[dict]) -> None:
    for rank in range(WORLD):
        assert ranks[rank]["attach"]["fsdp2_world"] == "ATTACHED fsdp2_reduce_scatter"
        assert ranks[rank]["attach"]["ddp_world"] == "ATTACHED ddp_comm_hook"


def test_a_second_hook_after_the_first_closed_builds_its_replica_groups_again(ranks: list[dict]) -> None:
    # The replica's gloo group of the second hook must not take the first one's name (and so
    # its rendezvous keys, still in the store): "Connection refused" at set-up if it does.
    assert [r["rebuild"] for r in ranks] == [[2, 2, 2, 2]] * WORLD

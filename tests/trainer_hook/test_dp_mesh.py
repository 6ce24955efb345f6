"""Issue 24: RebalanceHook(..., dp_mesh=M) balances the data-parallel replicas of a mesh job.

One real torchrun job of 4 gloo ranks (tests/trainer_hook/_dp_mesh_worker.py) runs every
case in turn: DP2 x TP2 (FSDP2 over mesh['dp'] + Colwise/Rowwise over 'tp'), HSDP 2 x 2 and
DP2 x TP2 with the token-mean loss and DDP over the 'dp' sub-group, each under three pushed placements; the parameters
must equal a single-process replay of the same global batches (float64, 1e-9)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.torchrun import run_torchrun
from tests.trainer_hook import _exact_worker as w
from tests.trainer_hook._dp_mesh_worker import PLANS, STEPS, tokens
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

"""Token-exact averaging: ``hook.token_loss_weight(n_valid)`` (issue 23)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.torchrun import run_torchrun
from tests.trainer_hook import _exact_worker as w
from tests.trainer_hook import _token_worker as tw
from trainer_hook import RebalanceHook
from trainer_hook.placement import PlacementSchedule
from trainer_hook.sampler import RebalanceBatchSampler

STEPS = 16


def _reference(steps: int) -> list[torch.Tensor]:
    """One process, the mean squared error over every valid token of each global batch."""
    ds = tw.Sequences()
    order = RebalanceBatchSampler(ds, schedule=PlacementSchedule(1, w.GLOBAL_BATCH), rank=0, shuffle=True, seed=5)
    model = w.build_model()
    opt = w.make_optimizer(model)
    for k in range(steps):
        idx = torch.tensor(order.global_batch(k))
        m = ds.mask[idx]
        (tw.loss_sum(model, ds.x[idx], ds.y[idx], m) / m.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in model.parameters()]


def test_one_process_gives_one_over_the_count_and_refuses_bad_counts() -> None:
    hook = RebalanceHook(job="t", global_batch_size=4)
    with hook.step():
        assert hook.token_loss_weight(8) == 0.125
        assert hook.token_loss_weight(0) == 0.0
        got = hook.token_loss_weight(torch.tensor(4))
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float64 and float(got) == 0.25
        with pytest.raises(ValueError, match=r"an integer >= 0 \(or a one-element tensor\), got -1"):
            hook.token_loss_weight(-1)
        with pytest.raises(ValueError, match=r"got a tensor of shape \(2,\)"):
            hook.token_loss_weight(torch.tensor([1, 2]))
    hook.close()


@pytest.mark.multiproc
@pytest.mark.parametrize("extra", [["--mode", "comm_hook"], ["--mode", "loss_scale", "--accum"]],
                         ids=["ddp_comm_hook", "loss_scale_grad_accum"])
def test_token_mean_under_changing_uneven_splits_gives_the_reference_parameters(tmp_path: Path, extra: list[str]) -> None:
    # Placements pushed at step 1 (uneven) and 6 (rank 2 drained: its dummy batch's tokens
    # must not count); lengths 1-6 tokens, some labels ignored.
    run_torchrun(3, ["tests/trainer_hook/_token_worker.py", "--out", str(tmp_path), "--steps", str(STEPS),
                     "--plan", "1=2,3,7;6=6,6,0", *extra], timeout=120)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    seen = {tuple(s) for s in ranks[0]["shares"]}
    assert {(2, 3, 7), (6, 6, 0)} <= seen, seen
    for got, want in zip(ranks[0]["params"], _reference(STEPS), strict=True):
        assert torch.allclose(torch.tensor(got, dtype=torch.float64), want, rtol=0, atol=1e-9)

"""Micro-batch placements (issue 41): a share counts fixed-shape micro-batches of each
rank's own stream; parameters equal a one-process replay of the same micro-batches."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.configs import run_configs
from tests.trainer_hook import _exact_worker as w
from tests.trainer_hook import _micro_worker as mw
from trainer_hook import RebalanceHook
from trainer_hook.microbatch import StreamEnded

M = 6
STEPS = 14
# Asked at an exchange's step + 1 (every 3 steps, lag 1, lookahead 1): uneven from step 5,
# rank 2 drained from step 8, back with uneven counts from step 11.
PLAN = "1=1,2,3;5=3,3,0;9=2,1,3"
CONFIGS = [["--wrap", "ddp"], ["--wrap", "ddp", "--loss", "tokens"], ["--wrap", "fsdp2", "--loss", "tokens"],
           ["--wrap", "compiled"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """Every configuration one after the other in one torchrun job of 3 ranks."""
    out = tmp_path_factory.mktemp("micro")
    return run_configs(3, ["tests/trainer_hook/_micro_worker.py", "--plan", PLAN, "--steps", str(STEPS),
                           "--micro-batches", str(M)], out, CONFIGS, timeout=240)


def replay(ids_per_step: list[list[int]], loss: str) -> list[torch.Tensor]:
    """One process: each step's M micro-batches, the mean over samples or over valid tokens."""
    model = w.build_model()
    opt = w.make_optimizer(model)
    for ids in ids_per_step:
        mbs = [mw.make(i) for i in ids]
        if loss == "tokens":
            total = sum(mb["mask"].sum() for mb in mbs)
            (sum(mw.token_loss_sum(model, mb) for mb in mbs) / total).backward()
        else:
            (sum(mw.mean_loss(model, mb) for mb in mbs) / len(mbs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in model.parameters()]


def _steps(ranks: list[dict[str, Any]]) -> list[list[int]]:
    """Each step's micro-batch ids over all ranks; checks each rank read its stream in order."""
    world = len(ranks)
    for r, d in enumerate(ranks):
        trained = [i for step in d["ids"] for i in step if i >= 0]
        assert trained == list(range(r, r + world * len(trained), world)), "a rank skipped or repeated"
    return [sorted(i for d in ranks for i in d["ids"][s] if i >= 0) for s in range(STEPS)]


@pytest.mark.multiproc
@pytest.mark.parametrize("cfg", range(len(CONFIGS)), ids=["ddp", "ddp-tokens", "fsdp2-tokens", "compiled"])
def test_parameters_equal_a_one_process_replay_under_changing_counts_and_a_drain(
        runs: list[list[dict[str, Any]]], cfg: int) -> None:
    ranks = runs[cfg]
    shares = [tuple(s) for s in ranks[0]["shares"]]
    assert (1, 2, 3) in shares and (3, 3, 0) in shares and (2, 1, 3) in shares, shares
    assert all(d["shares"] == ranks[0]["shares"] for d in ranks), "ranks switched at different steps"
    steps = _steps(ranks)
    assert all(len(ids) == M for ids in steps), "the global number of micro-batches changed"
    drained = [s for s, sh in enumerate(shares) if sh[2] == 0]
    assert drained and all(ranks[2]["ids"][s] == [-1] for s in drained)
    loss = "tokens" if "tokens" in CONFIGS[cfg] else "samples"
    got = [torch.tensor(p, dtype=torch.float64) for p in ranks[0]["params"]]
    for g, want in zip(got, replay(steps, loss), strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-9)
    if CONFIGS[cfg][1] == "compiled":
        assert all(d["graphs"] >= 1 for d in ranks), "nothing was compiled"
        assert [d["recompiles"] for d in ranks] == [0, 0, 0]


def _model() -> torch.nn.Module:
    return w.build_model()


def test_one_process_accumulates_its_micro_batches_into_the_mean() -> None:
    hook = RebalanceHook(micro_batches=4)
    model = _model()
    hook.attach(model)
    opt = w.make_optimizer(model)
    src = (mw.make(i) for i in itertools.count())
    for _ in range(3):
        with hook.step():
            for mb in hook.micro_batches(src):
                mw.mean_loss(model, mb).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    state = hook.state_dict()
    hook.close()
    assert state["stream"]["consumed"] == 12 and state["global_batch_size"] == 4
    for g, want in zip(model.parameters(), replay([list(range(s * 4, s * 4 + 4)) for s in range(3)], "samples"),
                       strict=True):
        torch.testing.assert_close(g.detach(), want, rtol=0, atol=1e-12)


def test_a_resumed_plain_stream_skips_what_was_trained() -> None:
    hook = RebalanceHook(micro_batches=2)
    hook.attach(_model())
    hook.load_state_dict({"format": 1, "batch_index": 3, "global_batch_size": 2, "world_size": 1,
                          "placement": {"version": 0, "shares": [2]}, "next_placement": None,
                          "stream": {"consumed": 6, "source_state": None, "pushback": []}})
    with hook.step():
        got = [int(mb["id"]) for mb in hook.micro_batches(mw.make(i) for i in itertools.count())]
    assert got == [6, 7] and hook.state_dict()["stream"]["consumed"] == 8
    hook.close()


def test_bad_input_gets_clear_errors() -> None:
    hook = RebalanceHook(micro_batches=3)
    with pytest.raises(RuntimeError, match=r"needs hook.attach\(model\) first"), hook.step():
        hook.micro_batches([])
    hook.close()
    hook = RebalanceHook(micro_batches=3)
    hook.attach(_model())
    with pytest.raises(RuntimeError, match=r"inside `with hook.step\(\):`"):
        hook.micro_batches([])
    with pytest.raises(ValueError, match="micro_batches=M .* hook.micro_batches"):
        hook.batch_sampler(10)
    short = iter([mw.make(0), mw.make(1)])
    with pytest.raises(StreamEnded, match=r"rank 0's stream ended at step 0: its share is 3 micro-batches, "
                                          r"the stream had 2 left"), hook.step():
        hook.micro_batches(short)
    hook.close()

    hook = RebalanceHook(micro_batches=2)
    hook.attach(_model())
    odd = iter([mw.make(0), {**mw.make(1), "x": torch.zeros(2, 4, 5, dtype=torch.float64)}])
    with pytest.raises(ValueError, match=r"micro-batch 1: its shapes \{x: \[2, 4, 5\] float64"), hook.step():
        hook.micro_batches(odd)
    hook.close()

    hook = RebalanceHook(micro_batches=2)
    hook.attach(_model())
    src = (mw.make(i) for i in itertools.count())
    with pytest.raises(RuntimeError, match="before its 2 micro-batches were all trained"), hook.step():
        for _ in hook.micro_batches(src):
            break
    with pytest.raises(RuntimeError, match="ended without hook.micro_batches"), hook.step():
        pass
    hook.close()
    with pytest.raises(ValueError, match=r"micro_batches \(4\) and global_batch_size \(8\) differ"):
        RebalanceHook(micro_batches=4, global_batch_size=8)


def test_a_drained_rank_peeks_a_micro_batch_and_trains_it_later(tmp_path: Path) -> None:
    from trainer_hook.microbatch import MicroBatchStream

    s = MicroBatchStream((mw.make(i) for i in itertools.count()), rank=1)
    dummy = s.dummy(step=0)
    assert int(dummy["id"]) == 0 and s.consumed == 0
    assert [int(mb["id"]) for mb in s.take(2, step=1)] == [0, 1]
    assert int(s.dummy(step=2)["id"]) == 1  # the newest trained one, nothing consumed
    assert s.state_dict()["consumed"] == 2


def test_the_framework_adapters_refuse_a_micro_batch_hook_naming_the_loop() -> None:
    from trainer_hook.integrations.accelerate import prepare_with_rebalancer

    hook = RebalanceHook(micro_batches=4)
    with pytest.raises(ValueError, match=r"prepare_with_rebalancer balances samples .* micro_batches=4 .* "
                                         r"hook.micro_batches\(stream\)"):
        prepare_with_rebalancer(object(), hook, _model(), None, [])
    pytest.importorskip("transformers")
    from trainer_hook.integrations.hf_trainer import RebalanceCallback

    with pytest.raises(ValueError, match="RebalanceCallback balances samples"):
        RebalanceCallback(hook)
    pytest.importorskip("pytorch_lightning")
    from trainer_hook.integrations.lightning import RebalanceLightningCallback

    with pytest.raises(ValueError, match="RebalanceLightningCallback balances samples"):
        RebalanceLightningCallback(hook)
    hook.close()

"""transformers Trainer integration: RebalancingTrainer keeps the math exact (2 gloo ranks).

One torchrun job runs every configuration after the other (``_hf_job --configs``); each
is still its own test, reading its results from the module fixture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.torchrun import run_torchrun
from tests.integrations._common import (
    assert_close_params,
    check_every_sample_once,
    global_batches,
    load,
    reference,
)

pytestmark = pytest.mark.timeout(300)

# The configurations of the module's one job, in order: (max_steps, accum, loss[, save|resume]).
# The first one's hook is created before the process group exists (issue 10).
CONFIGS = {
    "comm-hook": ["20", "1", "samples"],
    "accum2": ["9", "2", "samples"],
    "global-token-mean": ["20", "1", "tokens"],
    "sample-cost": ["20", "1", "tokens_cost"],
    "save": ["7", "1", "samples", "save"],
    "resume": ["20", "1", "samples", "resume"],  # from the checkpoint "save" left
}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every configuration's output folder, after the one job that ran them all."""
    out = tmp_path_factory.mktemp("hf_trainer")
    run_torchrun(2, ["-m", "tests.integrations._hf_job", "--configs", str(out), json.dumps(list(CONFIGS.values()))],
                 timeout=280)
    return {name: out / f"cfg{i}" for i, name in enumerate(CONFIGS)}


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("accum", "max_steps", "gradients", "loss"),
    [(1, 20, "comm_hook", "samples"), (2, 9, "loss_scale", "samples"), (1, 20, "loss_scale", "tokens")],
    ids=["comm-hook", "accum2", "global-token-mean"],
)
def test_trainer_matches_single_process_reference(job, request, accum, max_steps, gradients, loss):
    # "tokens": a model taking num_items_in_batch, samples with 1 to 3 valid targets; the
    # Trainer divides by the global batch's count, so no extra weight may be applied, and
    # a drained rank's dummy sample must not count among the tokens.
    name = request.node.callspec.id
    assert CONFIGS[name] == [str(max_steps), str(accum), loss]
    recs, params = load(job[name], 2)
    assert recs[0]["mode"] == "MULTI_CPU" and recs[0]["world"] == 2
    assert recs[0]["gradients"] == gradients
    assert recs[0]["loss_is_global"] == (loss == "tokens")
    assert recs[0]["global_step"] == max_steps
    # Measured (the hook was created before TrainingArguments): Accelerate's one-batch
    # peek plus the accumulation window the Trainer fetches at once.
    assert recs[0]["lookahead"] == 1 + accum
    # The ETA's total comes from max_steps, counted in hook steps (micro-batches, with the
    # short last accumulation window of each epoch): exactly the steps the run took.
    assert recs[0]["total_steps"] == recs[0]["hook_steps"]
    # Both placements were applied, by both ranks at the same batch index.
    assert [v for v, _ in recs[0]["acks"]] == [1, 2]
    assert recs[0]["acks"] == recs[1]["acks"]
    sizes = {b["version"]: len(b["idx"]) for b in recs[0]["batches"].values()}
    if loss == "tokens":  # version 2 drains rank 1: it trains a zero-weight dummy sample
        assert sizes == {0: 6, 1: 9, 2: 12}
        assert {b["version"]: b["dummy"] for b in recs[1]["batches"].values()} == {0: False, 1: False, 2: True}
    else:
        assert sizes == {0: 6, 1: 9, 2: 2}
    if accum > 1:  # one switch falls on the second micro-batch of an accumulation window
        assert any(k % 5 % accum == 1 and k % 5 < 4 for _, k in recs[0]["acks"]), recs[0]["acks"]
    batches = global_batches(recs)
    assert len(batches) == (20 if accum == 1 else 15)
    check_every_sample_once(batches)
    want = reference(batches, accum=accum, short_window_mean=True, tokens=loss == "tokens")
    for p in params:
        assert_close_params(p, want, rtol=1e-9)


@pytest.mark.multiproc
def test_trainer_with_sample_cost_matches_the_single_process_token_mean(job):
    # Issue 23: a per-sample cost, here sample i's valid-target count (i % 3 + 1), so shares
    # split tokens; the Trainer's global token mean (num_items_in_batch,
    # average_tokens_across_devices) stays exact. Placements 9:3 at step 1 and 12:0 (rank 1
    # drained) at step 5, as in the plain token case.
    recs, params = load(job["sample-cost"], 2)
    assert recs[0]["loss_is_global"] is True and recs[0]["gradients"] == "loss_scale"
    assert [v for v, _ in recs[0]["acks"]] == [1, 2]
    # Under the 9:3 split rank 0 trains about 3/4 of the tokens (not of the samples).
    mine = [i % 3 + 1 for b in recs[0]["batches"].values() if b["version"] == 1 for i in b["idx"]]
    theirs = [i % 3 + 1 for b in recs[1]["batches"].values() if b["version"] == 1 for i in b["idx"]]
    assert 0.7 <= sum(mine) / (sum(mine) + sum(theirs)) <= 0.8
    assert any(b["dummy"] for b in recs[1]["batches"].values() if b["version"] == 2)
    batches = global_batches(recs)
    check_every_sample_once([sorted(b) for b in batches])
    want = reference(batches, tokens=True)
    for p in params:
        assert_close_params(p, want, rtol=1e-9)


@pytest.mark.multiproc
def test_trainer_resumed_from_a_checkpoint_continues_where_it_stood(job):
    # Issue 10: a run resumed from a checkpoint started again at batch 0 with the uniform
    # split. The checkpoint at step 7 holds the hook's state; the Trainer skips the
    # epoch's 2 trained batches itself and the hook lines its sampler up with that. The
    # resumed run is a fresh Trainer and hook (in the job's process: Accelerate reset).
    first, second = job["save"], job["resume"]
    assert (first.parent / "hf_ckpt" / "checkpoint-7" / "rebalancer_state.json").is_file()
    before, _ = load(first, 2)
    recs, params = load(second, 2)
    assert min(int(k) for k in recs[0]["batches"]) == 7 and recs[0]["global_step"] == 20
    assert recs[0]["batches"]["7"]["version"] == before[0]["batches"]["6"]["version"] == 1
    assert [v for v, _ in recs[0]["acks"]] == [1, 2] and recs[0]["acks"][0] == [1, 7]
    for b, r in zip(before, recs, strict=True):
        r["batches"] = {**b["batches"], **r["batches"]}
    batches = global_batches(recs)
    assert len(batches) == 20
    check_every_sample_once(batches)
    want = reference(batches, accum=1, short_window_mean=True)
    for p in params:
        assert_close_params(p, want, rtol=1e-9)


def test_callback_alone_refuses_to_train(tmp_path, accelerate_state):
    # In this process: a refusal is a message, not multi-process behaviour; the Trainer's
    # Accelerate state and environment are put back after (accelerate_state).
    from transformers import Trainer, TrainingArguments

    from tests.integrations._common import IndexedData, TinyNet
    from trainer_hook import RebalanceHook
    from trainer_hook.integrations.hf_trainer import RebalanceCallback, RebalancingTrainer

    with RebalanceHook(global_batch_size=12, lookahead=2) as hook:
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=2, report_to=[],
                                 save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False)
        trainer = Trainer(model=TinyNet(), args=args, train_dataset=IndexedData(),
                          callbacks=[RebalanceCallback(hook)])
        with pytest.raises(RuntimeError, match="^RebalanceCallback needs the rebalancer's batch sampler"):
            trainer.train()
    with pytest.raises(ValueError, match="^rebalance_hook is required"):
        RebalancingTrainer(model=TinyNet(), args=args, rebalance_hook=None)

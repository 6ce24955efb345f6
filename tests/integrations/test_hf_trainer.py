"""transformers Trainer integration: RebalancingTrainer keeps the math exact (2 gloo ranks)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.helpers.torchrun import REPO_ROOT, job_env, run_torchrun
from tests.integrations._common import (
    assert_close_params,
    check_every_sample_once,
    global_batches,
    load,
    reference,
)

pytestmark = pytest.mark.timeout(150)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("accum", "max_steps", "gradients", "loss"),
    [(1, 20, "comm_hook", "samples"), (2, 9, "loss_scale", "samples"), (1, 20, "loss_scale", "tokens")],
    ids=["comm-hook", "accum2", "global-token-mean"],
)
def test_trainer_matches_single_process_reference(tmp_path, accum, max_steps, gradients, loss):
    # "tokens": a model taking num_items_in_batch, samples with 1 to 3 valid targets; the
    # Trainer divides by the global batch's count, so no extra weight may be applied, and
    # a drained rank's dummy sample must not count among the tokens.
    run_torchrun(2, ["-m", "tests.integrations._hf_job", str(tmp_path), str(max_steps), str(accum), loss])
    recs, params = load(tmp_path, 2)
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
def test_trainer_resumed_from_a_checkpoint_continues_where_it_stood(tmp_path):
    # Issue 10: a run resumed from a checkpoint started again at batch 0 with the uniform
    # split. The checkpoint at step 7 holds the hook's state; the Trainer skips the
    # epoch's 2 trained batches itself and the hook lines its sampler up with that.
    first, second = tmp_path / "first", tmp_path / "second"
    run_torchrun(2, ["-m", "tests.integrations._hf_job", str(first), "7", "1", "samples", "save"])
    assert (tmp_path / "hf_ckpt" / "checkpoint-7" / "rebalancer_state.json").is_file()
    run_torchrun(2, ["-m", "tests.integrations._hf_job", str(second), "20", "1", "samples", "resume"])
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


_CALLBACK_ALONE = textwrap.dedent(
    """
    import torch
    from transformers import Trainer, TrainingArguments
    from tests.integrations._common import IndexedData, TinyNet
    from trainer_hook import RebalanceHook
    from trainer_hook.integrations.hf_trainer import RebalanceCallback, RebalancingTrainer

    hook = RebalanceHook(global_batch_size=12, lookahead=2)
    args = TrainingArguments(output_dir="OUT", use_cpu=True, max_steps=2, report_to=[],
                             save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False)
    trainer = Trainer(model=TinyNet(), args=args, train_dataset=IndexedData(),
                      callbacks=[RebalanceCallback(hook)])
    try:
        trainer.train()
        print("ALONE no error")
    except RuntimeError as exc:
        print("ALONE", exc)
    try:
        RebalancingTrainer(model=TinyNet(), args=args, rebalance_hook=None)
    except ValueError as exc:
        print("NOHOOK", exc)
    """
)


@pytest.mark.multiproc
def test_callback_alone_refuses_to_train(tmp_path):
    # A subprocess: Accelerate's state is a process-wide singleton.
    code = _CALLBACK_ALONE.replace("OUT", str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=job_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert lines["ALONE"].startswith("RebalanceCallback needs the rebalancer's batch sampler")
    assert lines["NOHOOK"].startswith("rebalance_hook is required")

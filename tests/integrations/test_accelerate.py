"""Accelerate integration: exact training math with uneven, changing splits (2 gloo ranks).

Two torchrun jobs for the module: one runs the configurations after each other
(``_accelerate_job --configs``), ending with the run that saves a checkpoint and dies; the
other resumes from it in a fresh process. Each configuration is still its own test."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.torchrun import run_torchrun
from tests.integrations._common import (
    assert_close_params,
    check_every_sample_once,
    global_batches,
    load,
    reference,
)

pytestmark = pytest.mark.timeout(420)

# The configurations of the module's first job, in order: (steps, accum, workers[, save]).
# The first one's hook is created before the process group exists (issue 10); "save" ends
# its process, so it comes last.
CONFIGS = {
    "accum2-workers2": ["20", "2", "2"],
    "comm-hook": ["20", "1", "0"],
    "mismatch": ["mismatch"],
    "save": ["20", "1", "2", "save"],
}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every configuration's output folder, and "resume": the run resumed from "save"'s
    checkpoint, a job of its own (a fresh process, as after a crash)."""
    out = tmp_path_factory.mktemp("accelerate")
    target = ["-m", "tests.integrations._accelerate_job"]
    run_torchrun(2, [*target, "--configs", str(out), json.dumps(list(CONFIGS.values()))], timeout=240)
    run_torchrun(2, [*target, str(out / "resume"), "20", "1", "2", "resume"], timeout=100)
    return {**{name: out / f"cfg{i}" for i, name in enumerate(CONFIGS)}, "resume": out / "resume"}


@pytest.mark.multiproc
@pytest.mark.parametrize(("accum", "workers"), [(1, 0), (2, 2)], ids=["comm-hook", "accum2-workers2"])
def test_accelerate_matches_single_process_reference(job, request, accum, workers):
    name = request.node.callspec.id
    assert CONFIGS[name] == ["20", str(accum), str(workers)]
    recs, params = load(job[name], 2)
    assert recs[0]["mode"] == "MULTI_CPU" and recs[0]["world"] == 2
    # With workers the hook measured how far ahead the loader runs: 2 workers x 2
    # prefetched, Accelerate's one-batch peek and the batch in hand would make 6, but a
    # loader never runs past its epoch's end, and an epoch here is 5 batches.
    assert recs[0]["lookahead"] == (2 if workers == 0 else 5)
    # Both requested placements applied, on both ranks at the same batch index.
    assert [v for v, _ in recs[0]["acks"]] == [1, 2]
    assert recs[0]["acks"] == recs[1]["acks"]
    sizes = {b["version"]: len(b["idx"]) for b in recs[0]["batches"].values()}
    assert sizes == {0: 6, 1: 9, 2: 2}
    if accum > 1:  # one switch falls on the second micro-batch of an accumulation window
        assert any(k % 5 % accum == 1 and k % 5 < 4 for _, k in recs[0]["acks"]), recs[0]["acks"]
    batches = global_batches(recs)
    assert len(batches) == 20
    check_every_sample_once(batches)
    want = reference(batches, accum=accum)
    for p in params:
        assert_close_params(p, want, rtol=1e-9)
    # The reference is sensitive: ignoring accumulation would not match.
    if accum > 1:
        with pytest.raises(AssertionError):
            assert_close_params(params[0], reference(batches, accum=1), rtol=1e-9)


@pytest.mark.multiproc
def test_accelerate_save_state_and_load_state_resume_the_hook(job):
    # prepare_with_rebalancer registers the hook for checkpointing: load_state puts the
    # run back at batch 10 under the split it had, and the whole run matches the reference.
    first, second = job["save"], job["resume"]
    before, _ = load(first, 2)
    recs, params = load(second, 2)
    assert min(int(k) for k in recs[0]["batches"]) == 10
    # Version 1 was in force at batch 9; version 2, agreed for batch 12 before the
    # checkpoint, is offered again at the resumed run's first exchange.
    assert recs[0]["batches"]["10"]["version"] == before[0]["batches"]["9"]["version"] == 1
    assert [v for v, _ in recs[0]["acks"]] == [1, 2] and recs[0]["acks"][0] == [1, 10]
    for b, r in zip(before, recs, strict=True):
        r["batches"] = {**{k: v for k, v in b["batches"].items() if int(k) < 10}, **r["batches"]}
    batches = global_batches(recs)
    assert len(batches) == 20
    check_every_sample_once(batches)
    want = reference(batches)
    for p in params:
        assert_close_params(p, want, rtol=1e-9)


def test_accelerate_rejects_setups_it_cannot_keep_exact(accelerate_state):
    # In this process: a refusal is a message, not multi-process behaviour (one process, no
    # process group); Accelerate's process-wide state is reset after (accelerate_state).
    from accelerate import Accelerator, DataLoaderConfiguration

    from trainer_hook import RebalanceHook
    from trainer_hook.integrations.accelerate import prepare_with_rebalancer

    data = list(range(40))
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with RebalanceHook(global_batch_size=8, lookahead=2) as hook:
        acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
        with pytest.raises(ValueError, match=r"split_batches=True\) is not supported"):
            prepare_with_rebalancer(acc, hook, model, opt, data)
        acc.dataloader_config.split_batches = False
        with pytest.raises(ValueError, match=re.escape("DataLoader argument(s) ['batch_size'] cannot be set here")):
            prepare_with_rebalancer(acc, hook, model, opt, data, batch_size=4)
        with pytest.raises(ValueError, match="lookahead=6"):
            prepare_with_rebalancer(acc, hook, model, opt, data, num_workers=2)
        pm = acc.prepare_model(torch.nn.Linear(2, 1))
        with pytest.raises(ValueError, match=re.escape("already passed to accelerator.prepare()")):
            prepare_with_rebalancer(acc, hook, pm, opt, data)
        _, _, loader = prepare_with_rebalancer(acc, hook, model, opt, data, shuffle=False)
        assert next(iter(loader)).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


@pytest.mark.multiproc
@pytest.mark.skipif(torch.cuda.is_available(), reason="the mistake only exists without GPUs")
def test_accelerator_without_cpu_mode_is_refused(job):
    # Without cpu=True each torchrun process would be its own single-process Accelerator.
    lines = sorted((job["mismatch"] / f"rank{r}.txt").read_text() for r in (0, 1))
    assert lines == [
        f"rank {r}: Accelerate runs 1 process(es) but the hook sees world size 2. On a machine "
        "without GPUs create Accelerator(cpu=True) (or set ACCELERATE_USE_CPU=true), otherwise "
        "every process trains alone." for r in (0, 1)
    ]

"""PyTorch Lightning: Trainer(strategy="ddp") on 2 gloo ranks with uneven, changing splits
matches a single-process replay, and resumes from Lightning's own checkpoint."""

from __future__ import annotations

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

pytest.importorskip("pytorch_lightning")
pytestmark = [pytest.mark.timeout(200), pytest.mark.multiproc]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One 20-step run shared by both tests; its ModelCheckpoint saves at step 8 (mid-epoch).
    root = tmp_path_factory.mktemp("lightning")
    run_torchrun(2, ["-m", "tests.integrations._lightning_job", str(root / "full"), "20", str(root / "ckpt")],
                 timeout=150)
    return root


def test_lightning_ddp_matches_single_process_reference(full_run):
    recs, params = load(full_run / "full", 2)
    assert recs[0]["world"] == 2 and recs[0]["gradients"] == "ddp_comm_hook"
    assert recs[0]["total_steps"] == 20  # the Trainer's max_steps, for the backend's ETA
    # All three requested placements applied, on both ranks at the same batch index.
    assert [v for v, _ in recs[0]["acks"]] == [1, 2, 3]
    assert recs[0]["acks"] == recs[1]["acks"]
    sizes = {b["version"]: len(b["idx"]) for b in recs[0]["batches"].values()}
    assert sizes == {0: 6, 1: 9, 2: 2, 3: 7}
    batches = global_batches(recs)
    assert len(batches) == 20
    check_every_sample_once(batches)
    want = reference(batches)
    for p in params:
        assert_close_params(p, want, rtol=1e-9)


def test_lightning_resumes_from_its_own_checkpoint(full_run):
    # fit(ckpt_path=step8.ckpt): the callback's state (hook.state_dict()) puts the run back
    # at batch 8 under the split it had, with the placement agreed before the save.
    assert (full_run / "ckpt" / "step8.ckpt").is_file()
    run_torchrun(2, ["-m", "tests.integrations._lightning_job", str(full_run / "resumed"), "20",
                     str(full_run / "ckpt"), "resume"], timeout=150)
    before, _ = load(full_run / "full", 2)
    recs, params = load(full_run / "resumed", 2)
    assert min(int(k) for k in recs[0]["batches"]) == 8
    assert recs[0]["batches"]["8"]["version"] == before[0]["batches"]["8"]["version"] == 2
    assert recs[0]["acks"] == before[0]["acks"][1:]  # version 2 resumed at 8, version 3 at 10
    for b, r in zip(before, recs, strict=True):
        r["batches"] = {**{k: v for k, v in b["batches"].items() if int(k) < 8}, **r["batches"]}
    batches = global_batches(recs)
    assert batches == global_batches(before)
    want = reference(batches)
    for p in params:
        assert_close_params(p, want, rtol=1e-9)

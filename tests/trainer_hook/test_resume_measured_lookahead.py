"""A run resumed mid-epoch with ``hook.data_loader(..., num_workers=2)`` and the lookahead
left to be measured (the default) must continue where it stood, exactly as with a fixed
lookahead (found by the tokens work: it failed with "The placement for batch 17 is not
settled yet"; ``_cost_worker.py`` worked around it with ``lookahead=6``). A resume at batch
14, on the exchange grid, is test_exactness.py's resume test (its first half in that file's
shared job); here one off the grid."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer_hook.test_exactness import (
    STEPS,
    _check_every_sample_once,
    _reference_params,
    _run,
)

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("resume_at", [11])  # off the exchange grid (every 3), 4 batches left
def test_a_resume_with_workers_and_the_measured_lookahead_continues_where_it_stood(
        tmp_path: Path, resume_at: int) -> None:
    plan = "1=2,10;5=12,0;9=1,11;12=5,7"  # two ranks; the second placement drains rank 1
    ckpt = str(tmp_path / "ckpt.pt")
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    common = ("--plan", plan, "--ckpt", ckpt, "--loader", "hook", "--num-workers", "2", "--lookahead", "default")
    before = _run(first, *common, "--save-at", str(resume_at), nproc=2)
    after = _run(second, *common, "--resume", nproc=2)
    for b, a in zip(before, after, strict=True):  # the split the first run had at that batch
        (had,) = [e for e in b["seen"] if e["k"] == resume_at]
        assert a["seen"][0]["k"] == resume_at and a["seen"][0]["shares"] == had["shares"]
    merged = [{"seen": [e for e in b["seen"] if e["k"] < resume_at] + a["seen"]} for b, a in zip(before, after, strict=True)]
    _check_every_sample_once(merged)
    got = [torch.tensor(p, dtype=torch.float64) for p in after[0]["params"]]
    for g, r in zip(got, _reference_params(STEPS), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)

"""HF Trainer with a per-sample cost (issue 23): shares split tokens, the Trainer's global
token mean (``num_items_in_batch``, ``average_tokens_across_devices``) stays exact."""

from __future__ import annotations

import pytest

from tests.helpers.torchrun import run_torchrun
from tests.integrations._common import (
    assert_close_params,
    check_every_sample_once,
    global_batches,
    load,
    reference,
)

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(150)


@pytest.mark.multiproc
def test_trainer_with_sample_cost_matches_the_single_process_token_mean(tmp_path):
    # The cost of sample i is its valid-target count (i % 3 + 1); placements 9:3 at step 1
    # and 12:0 (rank 1 drained) at step 5, as in the plain token case.
    run_torchrun(2, ["-m", "tests.integrations._hf_job", str(tmp_path), "20", "1", "tokens_cost"])
    recs, params = load(tmp_path, 2)
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

"""notebook_launch: accelerate.notebook_launcher forks 2 CPU ranks that train with the hook."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.torchrun import REPO_ROOT, job_env
from tests.integrations._common import (
    assert_close_params,
    check_every_sample_once,
    global_batches,
    load,
    reference,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.multiproc
def test_notebook_launch_trains_two_ranks_and_applies_a_placement(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integrations._notebook_job", str(tmp_path), "10"],
        env=job_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=100,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs, params = load(tmp_path, 2)
    # Without CPU mode each forked process would run alone (world 1, DistributedType NO).
    assert [(r["mode"], r["world"]) for r in recs] == [("MULTI_CPU", 2), ("MULTI_CPU", 2)]
    assert recs[0]["acks"] == recs[1]["acks"] == [[1, 5]]
    sizes = sorted({(b["version"], len(b["idx"])) for b in recs[1]["batches"].values()})
    assert sizes == [(0, 6), (1, 3)]
    batches = global_batches(recs)
    check_every_sample_once(batches)
    want = reference(batches)
    for p in params:
        assert_close_params(p, want, rtol=1e-9)

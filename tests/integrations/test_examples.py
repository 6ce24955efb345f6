"""The integration examples run as documented (2 CPU ranks) and apply a requested split."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.torchrun import REPO_ROOT, job_env, run_torchrun

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(150)]

# Asked at batch 13, announced at the exchange at batch 16 (exchange_every 4), in force from
# batch 16 + 2 + 2 = 20 (the measured lookahead is 2: Accelerate's one-batch peek): after
# epoch 0 (16 batches), before the end of epoch 1.
REQUEST = ["--request", "13:96,32"]


@pytest.mark.parametrize("script", ["examples/accelerate_train.py", "examples/hf_trainer_train.py"])
def test_torchrun_example_applies_the_requested_split(script):
    proc = run_torchrun(2, [script, *REQUEST])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2, proc.stdout
    assert lines[0].endswith("placement v0 [64, 64]")
    assert lines[-1].endswith("placement v1 [96, 32]")


def test_notebook_example_runs_two_ranks():
    proc = subprocess.run(
        [sys.executable, "examples/notebook_launch.py", "--num-processes", "2", *REQUEST],
        env=job_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2 and "world 2" in lines[-1], proc.stdout
    assert lines[-1].endswith("placement v1 [96, 32]")


def test_notebook_file_cells_run_in_order():
    # The notebook's code cells, run top to bottom in one interpreter (as a kernel would).
    cells = json.loads((Path(REPO_ROOT) / "examples" / "notebook.ipynb").read_text())["cells"]
    code = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    proc = subprocess.run(
        [sys.executable, "-c", code], env=job_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2 and lines[-1].endswith("world 2, placement v1 [96, 32]"), proc.stdout

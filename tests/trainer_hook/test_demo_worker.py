"""demo_worker: its CLI, its injected speeds, and compute vs wall time of a slowed rank."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.torchrun import REPO_ROOT, job_env, run_torchrun
from trainer_hook.demo_worker import delay_ms, parse_args


def test_delay_model_with_speed_slowdown_and_drift() -> None:
    args = parse_args(["--speeds", "1,0.5", "--per-sample-ms", "2", "--fixed-ms", "1",
                       "--slowdown", "1:10:3", "--drift", "0:5:10"])
    assert delay_ms(args, 0, 0, 8) == pytest.approx(17.0)
    assert delay_ms(args, 1, 0, 8) == pytest.approx(33.0)
    assert delay_ms(args, 1, 10, 8) == pytest.approx(99.0)
    assert delay_ms(args, 0, 7, 8) == pytest.approx(17.0 * 1.2)  # 10 % per step for 2 steps
    assert delay_ms(args, 1, 3, 0) == pytest.approx(1.0)  # drained: fixed cost only


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speeds", "1,0,2"], "--speeds must be positive numbers"),
        (["--speeds", "fast"], "--speeds expects numbers"),
        (["--slowdown", "1:2"], "--slowdown expects RANK:STEP:VALUE like 2:100:3.0"),
        (["--drift", "a:1:2"], "--drift expects RANK:STEP:VALUE"),
        (["--steps", "-1"], "--steps must be >= 0"),
    ],
)
@pytest.mark.multiproc
def test_bad_arguments_exit_2_with_a_reason(argv: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "trainer_hook.demo_worker", *argv], capture_output=True,
                          text=True, env=job_env(), cwd=REPO_ROOT, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.multiproc
def test_speeds_must_match_world_size() -> None:
    proc = subprocess.run([sys.executable, "-m", "trainer_hook.demo_worker", "--speeds", "1,2", "--steps", "1"],
                          capture_output=True, text=True, env=job_env(), cwd=REPO_ROOT, timeout=60)
    assert proc.returncode == 2
    assert "--speeds gives 2 values but the job has 1 ranks" in proc.stderr


@pytest.mark.multiproc
def test_slowed_rank_has_higher_compute_but_equal_wall_step(tmp_path: Path) -> None:
    # Offline (no backend): rank 1 computes at a quarter of rank 0's speed.
    out = tmp_path / "result.json"
    run_torchrun(2, ["-m", "trainer_hook.demo_worker", "--steps", "30", "--global-batch-size", "16",
                     "--speeds", "1,0.25", "--per-sample-ms", "2", "--result", str(out)], timeout=120)
    result = json.loads(out.read_text())
    assert result["steps"] == 30 and result["world_size"] == 2
    fast, slow = (result["records"][r][5:] for r in (0, 1))  # skip warm-up steps

    def med(recs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in recs)

    assert med(slow, "compute_ms") > 2.5 * med(fast, "compute_ms")
    assert med(fast, "sync_wait_ms") > 2.0 * med(slow, "sync_wait_ms")
    assert med(slow, "step_ms") == pytest.approx(med(fast, "step_ms"), rel=0.15)
    assert result["placements"] == [{"version": 0, "start_batch": 0, "shares": [8, 8]}]

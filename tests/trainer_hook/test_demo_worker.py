"""demo_worker: its CLI and its injected speeds. A slowed rank's compute vs wall time, in a
real job reporting to a backend: tests/backend/test_e2e_ingest.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.torchrun import REPO_ROOT, job_env
from trainer_hook.demo_worker import delay_ms, main, parse_args


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
def test_bad_arguments_exit_2_with_a_reason(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # In process: argparse refuses before anything starts (a fresh interpreter each would
    # cost a torch import, 2.5 CPU-s); the one below runs `python -m` for its exit status.
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.multiproc
def test_speeds_must_match_world_size() -> None:
    proc = subprocess.run([sys.executable, "-m", "trainer_hook.demo_worker", "--speeds", "1,2", "--steps", "1"],
                          capture_output=True, text=True, env=job_env(), cwd=REPO_ROOT, timeout=60)
    assert proc.returncode == 2
    assert "--speeds gives 2 values but the job has 1 ranks" in proc.stderr

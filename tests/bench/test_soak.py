"""The soak harness: its verdicts on made-up ends, its hang handling on a real hung job,
and the short soak CI runs (one run of each main launch path, real torchrun/gloo jobs
against a real backend; the exits have their own test in tests/trainer_hook)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench._launch import LaunchResult, launch
from bench.soak import CI_PATHS, PATHS, classify, markdown_table

REPO_ROOT = Path(__file__).resolve().parents[2]


def _res(output: str, rc: int | None = 0, *, hung: bool = False, leaked: list[str] | None = None) -> LaunchResult:
    from bench._launch import ABNORMAL_PATTERNS

    return LaunchResult(cmd=[], returncode=rc, hung=hung, wall_s=1.0, output=output, leaked=leaked or [],
                        findings=[p for p in ABNORMAL_PATTERNS if p in output])


def test_verdicts_name_every_kind_of_bad_end() -> None:
    ddp = PATHS["ddp-w0"]
    assert classify(ddp, _res("[soak] done: 60 steps")) == []
    assert classify(ddp, _res("", None, hung=True)) == ["hang"]
    aborted = _res("[soak] done\nterminate called without an active exception\n  exitcode  : -6 (pid: 9)", 1)
    assert classify(ddp, aborted) == ["a worker was killed by a signal", "output: terminate called",
                                      "torchrun exit 1", "worker exit codes [-6]"]
    assert classify(ddp, _res("[soak] done", leaked=["12 python worker"])) == ["leaked 1 process(es)"]
    assert classify(ddp, _res("[soak] done\nSOAK-THREADS-LEFT rank 0: rebalancer-transport")) == \
        ["output: SOAK-THREADS-LEFT"]
    assert classify(ddp, _res("step 3")) == ["no '[soak] done' in the output"]
    user = PATHS["end-exception"]
    ended = "SoakUserError: boom\n  exitcode  : -15 (pid: 8)  (SIGTERM)\n  exitcode  : 1 (pid: 9)"
    assert classify(user, _res(ended, 1)) == []
    assert classify(user, _res("SoakUserError: boom\n  exitcode  : -6 (pid: 9)", 1)) == \
        ["a worker was killed by a signal", "worker exit codes [-6] (expected [1, -15])"]
    assert classify(user, _res("[soak] done", 0))[0] == "no 'SoakUserError' in the output"


def test_markdown_table_says_why_a_path_failed() -> None:
    report = {"totals": {"runs": 3, "hangs": 1, "abnormal": 1}, "paths": [
        {"path": "ddp-w0", "runs": 2, "hangs": 1, "abnormal": 0, "reasons": {"hang": 1},
         "wall_s_median": 9.5, "wall_s_max": 120.0},
        {"path": "fsdp2", "runs": 1, "hangs": 0, "abnormal": 1, "reasons": {"torchrun exit 1": 1},
         "wall_s_median": 8.0, "wall_s_max": 8.0}]}
    lines = markdown_table(report).splitlines()
    assert lines[2] == "| `ddp-w0` | 2 | 1 | 0 | 9.5 / 120.0 |"
    assert lines[3] == "| `fsdp2` | 1 | 0 | 1 (1 x torchrun exit 1) | 8.0 / 8.0 |"
    assert lines[-1] == "| **all** | **3** | **1** | **1** | |"


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_hung_job_is_killed_with_every_process_stacks(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text("import subprocess, sys, time\n"
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
                      "                 start_new_session=True)  # as torchrun starts its ranks\n"
                      "def stuck_here():\n    time.sleep(600)\n"
                      "stuck_here()\n")
    res = launch([sys.executable, str(script)], timeout=3, log_path=tmp_path / "log")
    assert res.hung and res.returncode is None
    assert "stuck_here" in res.output  # the parent's stack, printed on SIGUSR1
    assert res.output.count("most recent call first") >= 2  # and the child's, in a session of its own
    check = subprocess.run(["pgrep", "-f", "time.sleep\\(600\\)"], capture_output=True, text=True)
    assert str(script) not in check.stdout and check.stdout.strip() == "", "a process of the hung job survived"


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_short_soak_every_main_path_once(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--runs", "1", "--paths", ",".join(CI_PATHS), "--out", str(out),
         "--log-dir", str(tmp_path / "logs")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=560,
    )
    assert out.exists(), proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    bad = {p["path"]: (p["reasons"], [f["stacks"] for f in p["failures"]]) for p in report["paths"]
           if p["hangs"] or p["abnormal"]}
    assert not bad, f"{proc.stdout[-3000:]}\n{json.dumps(bad, indent=1)[:8000]}"
    assert proc.returncode == 0 and report["totals"]["runs"] == len(CI_PATHS)


def test_the_report_goes_into_a_folder_given_as_out(tmp_path):
    from bench.soak import report_path

    assert report_path(tmp_path) == tmp_path / "soak.json"
    assert report_path(tmp_path / "mine.json") == tmp_path / "mine.json"

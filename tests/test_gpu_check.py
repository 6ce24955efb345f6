"""scripts/gpu-check's plumbing on CPU (its rehearsal, one GPU test and a tiny bench), so the
script is known to work before its first run on a CUDA device; its report; the GPU tests' skip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_check_report import report
from tests.helpers.torchrun import REPO_ROOT

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
SCRIPT = os.path.join(REPO_ROOT, "scripts", "gpu-check")


def _run(*args: str, out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "PYTHONPATH": REPO_ROOT, **(env or {})}
    env.pop("REBALANCER_GPU_REHEARSAL", None)
    return subprocess.run([SCRIPT, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)


@no_cuda
@pytest.mark.multiproc
def test_rehearsal_runs_a_gpu_test_and_the_bench_and_writes_the_results(tmp_path: Path) -> None:
    done = _run("--rehearse", "--pytest-args", "-k test_name_memory_and_clocks_agree_with_torch",
                "--bench-args", "--steps 2 --rounds 1 --width 16 --batch 8", out=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    res = json.loads((tmp_path / "gpu-check.json").read_text())
    assert res["ok"] is True and res["mode"] == "rehearsal" and res["device"] == "none (CPU rehearsal)"
    assert (res["pytest"]["passed"], res["pytest"]["failed"], res["pytest"]["error"]) == (1, 0, 0)
    (test,) = res["pytest"]["tests"]
    assert test["name"] == "tests.gpu.test_nvml::test_name_memory_and_clocks_agree_with_torch"
    assert res["facts"]["nvml_device"]["name"] == "Rehearsal CPU stand-in"
    bench = res["bench"]["result"]
    assert res["bench"]["rc"] == 0 and bench["benchmark"] == "gpu_step" and bench["steps"] == 2
    assert bench["gradients"] == "ddp_comm_hook" and bench["step_enter_exit_us_median"] > 0
    assert (tmp_path / "junit.xml").exists() and "1 passed" in (tmp_path / "pytest.txt").read_text()
    assert "gpu-check OK (rehearsal, none (CPU rehearsal)): 1 passed, 0 failed" in done.stdout
    assert f"results: {tmp_path / 'gpu-check.json'}" in done.stdout


@no_cuda
@pytest.mark.multiproc
def test_without_cuda_it_refuses_and_names_the_rehearsal(tmp_path: Path) -> None:
    done = _run("--no-bench", out=tmp_path)
    assert done.returncode == 2
    assert "has no CUDA device (torch.cuda.is_available() is False); run scripts/gpu-check --rehearse" in done.stdout
    assert not (tmp_path / "gpu-check.json").exists()


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_nvml" name="test_a" time="1.5"/>
<testcase classname="tests.gpu.test_timing" name="test_b" time="2.0"><failure message="assert 3.1 &lt;= 1.6">x</failure></testcase>
<testcase classname="tests.gpu.test_ddp" name="test_c" time="0"><skipped message="no CUDA"/></testcase>
</testsuite></testsuites>"""


def test_report_names_a_failed_test_and_fails_the_check(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text(JUNIT)
    (tmp_path / "facts").mkdir()
    (tmp_path / "facts" / "nvml_device.json").write_text('{"name": "X"}')
    ok, doc, lines = report(tmp_path, mode="rehearsal", pytest_rc=1, pytest_s=12, bench_rc=-1, bench_s=0,
                            total_s=20, torch_version="2.13.0+cpu", torch_cuda="None")
    assert not ok and doc["ok"] is False and doc["cuda"] is None
    assert (doc["pytest"]["passed"], doc["pytest"]["failed"], doc["pytest"]["skipped"]) == (1, 1, 1)
    assert doc["facts"] == {"nvml_device": {"name": "X"}}
    assert lines[0] == ("gpu-check FAILED (rehearsal, none (CPU rehearsal)): 1 passed, 1 failed, 0 errors, "
                        "1 skipped in 12 s (pytest rc 1); bench skipped; 20 s in all")
    assert lines[1] == "  FAILED tests.gpu.test_timing::test_b: assert 3.1 <= 1.6"
    assert json.loads((tmp_path / "gpu-check.json").read_text())["pytest"]["tests"][1]["outcome"] == "failed"


def test_report_fails_a_run_without_a_passed_test_or_with_a_failed_bench(tmp_path: Path) -> None:
    args = {"mode": "rehearsal", "pytest_s": 1, "bench_s": 1, "total_s": 2, "torch_version": "", "torch_cuda": "None"}
    ok, _, lines = report(tmp_path, pytest_rc=5, bench_rc=0, **args)  # no junit: nothing ran
    assert not ok and "0 passed" in lines[0]
    (tmp_path / "junit.xml").write_text(JUNIT.replace('<failure message="assert 3.1 &lt;= 1.6">x</failure>', ""))
    assert report(tmp_path, pytest_rc=0, bench_rc=-1, **args)[0]
    ok, _, lines = report(tmp_path, pytest_rc=0, bench_rc=124, **args)  # the bench timed out
    assert not ok and "bench rc 124" in lines[0]


def test_gpu_tests_skip_without_cuda_unless_rehearsing(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.gpu import _rig

    monkeypatch.setattr(_rig, "cuda", lambda: False)
    monkeypatch.delenv(_rig.REHEARSAL_ENV, raising=False)
    reason = _rig.skip_reason()
    assert reason is not None and reason.startswith("no CUDA device (torch ")
    assert reason.endswith("on a CUDA machine run scripts/gpu-check, here scripts/gpu-check --rehearse")
    monkeypatch.setenv(_rig.REHEARSAL_ENV, "1")
    assert _rig.skip_reason() is None
    monkeypatch.setattr(_rig, "cuda", lambda: True)
    monkeypatch.delenv(_rig.REHEARSAL_ENV)
    assert _rig.skip_reason() is None

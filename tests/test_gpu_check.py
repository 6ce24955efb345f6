"""scripts/gpu-check's plumbing on CPU (its rehearsal, one GPU test and a tiny bench), so the
script is known to work before its first run on a CUDA device; and the GPU tests' skip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.torchrun import REPO_ROOT

pytestmark = pytest.mark.multiproc
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
SCRIPT = os.path.join(REPO_ROOT, "scripts", "gpu-check")


def _run(*args: str, out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "PYTHONPATH": REPO_ROOT, **(env or {})}
    env.pop("REBALANCER_GPU_REHEARSAL", None)
    return subprocess.run([SCRIPT, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)


@no_cuda
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
def test_without_cuda_it_refuses_and_names_the_rehearsal(tmp_path: Path) -> None:
    done = _run("--no-bench", out=tmp_path)
    assert done.returncode == 2
    assert "has no CUDA device (torch.cuda.is_available() is False); run scripts/gpu-check --rehearse" in done.stdout
    assert not (tmp_path / "gpu-check.json").exists()


@no_cuda
def test_a_failing_gpu_test_fails_the_check_and_is_named(tmp_path: Path) -> None:
    # A test id that selects nothing: no test passed, so the check cannot say OK.
    done = _run("--rehearse", "--no-bench", "--pytest-args", "-k no_such_gpu_test", out=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    res = json.loads((tmp_path / "gpu-check.json").read_text())
    assert res["ok"] is False and res["pytest"]["passed"] == 0 and res["bench"]["rc"] == -1
    assert "gpu-check FAILED (rehearsal" in done.stdout


@no_cuda
def test_gpu_tests_are_skipped_without_cuda_with_the_reason() -> None:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop("REBALANCER_GPU_REHEARSAL", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests/gpu/test_nvml.py"],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout
    assert "3 skipped" in done.stdout
    assert "no CUDA device (torch " in done.stdout and "here scripts/gpu-check --rehearse" in done.stdout

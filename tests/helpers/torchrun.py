"""Launch real multi-process jobs with torchrun (gloo on loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from tests.helpers.ports import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchrun_cmd(nproc: int, target: Sequence[str], *, max_restarts: int = 0) -> list[str]:
    """``target`` is ``["-m", "module", ...args]`` or ``["path/to/script.py", ...args]``."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "--max-restarts", str(max_restarts),
        *target,
    ]


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT}
    env.update(extra or {})
    return env


def run_torchrun(
    nproc: int,
    target: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 240.0,
    max_restarts: int = 0,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run a torchrun job to completion; on failure raise with its whole output."""
    proc = subprocess.run(
        torchrun_cmd(nproc, target, max_restarts=max_restarts),
        env=job_env(env), capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def start_torchrun(
    nproc: int, target: Sequence[str], *, env: dict[str, str] | None = None, max_restarts: int = 0,
) -> subprocess.Popen[str]:
    """Start a torchrun job in the background (caller waits or kills it)."""
    return subprocess.Popen(
        torchrun_cmd(nproc, target, max_restarts=max_restarts),
        env=job_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
        start_new_session=True,
    )

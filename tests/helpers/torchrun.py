"""Launch real multi-process jobs with torchrun (gloo on loopback)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence

import psutil

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
    timeout: float = 100.0,
    max_restarts: int = 0,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run a torchrun job to completion; on failure raise with its whole output.

    A job still running after ``timeout`` seconds is a hang: its workers are sent SIGABRT
    (``PYTHONFAULTHANDLER`` makes each print every thread's Python stack), the whole
    process group is killed, and the error carries those stacks. Keep ``timeout`` below
    the test's own pytest timeout so that this report, not pytest's, explains a hang.
    """
    cmd = torchrun_cmd(nproc, target, max_restarts=max_restarts)
    proc = subprocess.Popen(
        cmd, env=job_env({"PYTHONFAULTHANDLER": "1", **(env or {})}), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _abort_hung_job(proc)
        raise AssertionError(
            f"torchrun did not finish in {timeout:.0f}s (hung); every worker's stacks follow."
            f"\nstdout:\n{out}\nstderr:\n{err}"
        ) from None
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and done.returncode != 0:
        raise AssertionError(f"torchrun exited {done.returncode}\nstdout:\n{out}\nstderr:\n{err}")
    return done


def _abort_hung_job(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGABRT the workers (they dump their stacks), then kill everything; return the output."""
    try:
        workers = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    for w in workers:
        with contextlib.suppress(psutil.Error):
            w.send_signal(signal.SIGABRT)
    try:
        return proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return proc.communicate()


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def start_torchrun(
    nproc: int, target: Sequence[str], *, env: dict[str, str] | None = None, max_restarts: int = 0,
) -> subprocess.Popen[str]:
    """Start a torchrun job in the background (caller waits or kills it)."""
    return subprocess.Popen(
        torchrun_cmd(nproc, target, max_restarts=max_restarts),
        env=job_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
        start_new_session=True,
    )


@contextlib.contextmanager
def running_torchrun(
    nproc: int, target: Sequence[str], *, env: dict[str, str] | None = None, max_restarts: int = 0,
) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """A background torchrun job and its output lines (read on a thread as they come);
    on exit SIGTERM to its process group, then SIGKILL after 20 s."""
    proc = start_torchrun(nproc, target, env=env, max_restarts=max_restarts)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        yield proc, out
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
        reader.join(timeout=5)

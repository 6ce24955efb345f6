"""Run one torchrun job to its end or its timeout and say how it ended, honestly.

``launch(...)`` starts torchrun in a session of its own with output to a file and follows
its process tree. If the job outlives its timeout it is a hang: every process of the job
is sent SIGUSR1,
on which each Python process prints every thread's stack (``faulthandler``, enabled in
all of them, the torchrun agent and DataLoader workers included, by the
``sitecustomize`` in ``bench/_soak_site`` that ``REBALANCER_SOAK_FAULTHANDLER=1``
turns on), and then every one is killed. A job that ended by itself is still
checked: processes of the job left running (a leak; killed after the check),
``terminate called`` or ``Fatal Python error`` in the output, and the thread report the
soak worker prints at exit (``SOAK-THREADS-LEFT``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench._backend import REPO_ROOT, free_port

__all__ = ["LaunchResult", "launch", "torchrun_cmd", "ABNORMAL_PATTERNS"]

SITE_DIR = Path(__file__).resolve().parent / "_soak_site"
# Output that means an abnormal end whatever the exit code says.
ABNORMAL_PATTERNS = (
    "terminate called",
    "Fatal Python error",
    "Segmentation fault",
    "core dumped",
    "SOAK-THREADS-LEFT",
)
_DUMP_WAIT_S = 5.0  # how long the processes get to print their stacks on SIGUSR1
_LEAK_GRACE_S = 3.0  # a worker's children may take a moment to notice their parent left


@dataclass
class LaunchResult:
    cmd: list[str]
    returncode: int | None  # None when the job hung and was killed
    hung: bool
    wall_s: float
    output: str
    leaked: list[str] = field(default_factory=list)  # "pid name cmdline" of processes left running
    findings: list[str] = field(default_factory=list)  # ABNORMAL_PATTERNS seen in the output


def torchrun_cmd(nproc: int, target: Sequence[str], *, max_restarts: int = 0, rdzv_c10d: bool = False) -> list[str]:
    """``target`` is ``["-m", "module", ...args]`` or ``["script.py", ...args]``; ``rdzv_c10d``:
    the c10d rendezvous instead of the static one (restartable jobs)."""
    port = str(free_port())
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"] if rdzv_c10d else \
        ["--master-addr", "127.0.0.1", "--master-port", port]
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(nproc), *rdzv,
        "--max-restarts", str(max_restarts),
        *target,
    ]


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a soak job: unbuffered, one OMP thread, the repository and the
    faulthandler ``sitecustomize`` on the path."""
    path = os.pathsep.join([str(SITE_DIR), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path,
           "REBALANCER_SOAK_FAULTHANDLER": "1", "PYTHONFAULTHANDLER": "1"}
    env.update(extra or {})
    return env


def launch(
    cmd: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 120.0, log_path: Path,
) -> LaunchResult:
    """Run ``cmd`` (a torchrun command line) in its own session; see the module docstring.

    torchrun starts each rank in a session of its own, so the job is not one process
    group: the launcher follows the whole tree of torchrun's descendants (polled while
    the job runs, so processes orphaned by a dying parent are still known) and signals
    and kills every one of them.
    """
    started = time.monotonic()
    hung = False
    with open(log_path, "w+b") as log:
        proc = subprocess.Popen(
            list(cmd), env=job_env(env), stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
            start_new_session=True,
        )
        seen: dict[int, float] = {}  # pid -> create_time of every descendant seen
        try:
            root = psutil.Process(proc.pid)
            seen[proc.pid] = root.create_time()
        except psutil.Error:
            root = None
        deadline = started + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            _note_tree(root, seen)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.5)
        try:
            if proc.poll() is None:
                hung = True
                _note_tree(root, seen)
                log.write(f"\n=== SOAK: no end after {timeout:.0f}s; SIGUSR1 to every process for stacks ===\n".encode())
                log.write(("\n".join(_describe(p) for p in _alive(seen)) + "\n").encode())
                log.flush()
                for p in _alive(seen):
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(signal.SIGUSR1)
                time.sleep(_DUMP_WAIT_S)
        finally:
            wall = time.monotonic() - started
            leaked: list[str] = []
            if not hung:
                grace = time.monotonic() + _LEAK_GRACE_S
                while _alive(seen) and time.monotonic() < grace:
                    time.sleep(0.1)
                leaked = [_describe(p) for p in _alive(seen)]
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            for p in _alive(seen):
                with contextlib.suppress(psutil.Error):
                    p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        log.seek(0)
        output = log.read().decode(errors="replace")
    findings = sorted({pat for pat in ABNORMAL_PATTERNS if pat in output})
    return LaunchResult(
        cmd=list(cmd), returncode=None if hung else proc.returncode, hung=hung, wall_s=wall,
        output=output, leaked=leaked, findings=findings,
    )


def _note_tree(root: psutil.Process | None, seen: dict[int, float]) -> None:
    if root is None:
        return
    with contextlib.suppress(psutil.Error):
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                seen.setdefault(child.pid, child.create_time())


def _alive(seen: dict[int, float]) -> list[psutil.Process]:
    """Processes of the job still running (the same process: pid and start time; zombies
    are dead and not a leak)."""
    found = []
    for pid, created in seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {p.name()} {' '.join(p.cmdline())[:200]}"
    except psutil.Error:
        return str(p.pid)


_STACK_START = re.compile(r"^(Thread 0x[0-9a-f]+|Current thread 0x[0-9a-f]+|Fatal Python error|terminate called)",
                          re.MULTILINE)


def first_stacks(output: str, limit: int = 6000) -> str:
    """The output from the first stack dump or abort message on (or its tail), capped."""
    m = _STACK_START.search(output)
    text = output[max(0, m.start() - 400):] if m else output[-limit:]
    return text[:limit]

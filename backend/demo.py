"""``rebalancer demo``: the backend plus a real multi-rank CPU DDP job with uneven speeds.

Starts ``rebalancer serve`` as a child process on the port (a free one if it is busy),
then ``torchrun -m trainer_hook.demo_worker`` with gloo on loopback, and prints the
dashboard URL. When ``--steps`` are done the backend and the finished job's page stay up
until Ctrl-C (``--exit-when-done`` stops instead, for scripts). Ctrl-C stops the job's
process group first and the server second.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from backend.process import free_port, port_free, spawn_backend, stop_process, wait_healthy

__all__ = ["run_demo", "DEFAULT_SPEEDS"]

DEFAULT_SPEEDS = "1,1,0.5,0.25"


def _speeds(text: str, ranks: int) -> list[float]:
    try:
        speeds = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--speeds expects numbers like {DEFAULT_SPEEDS}, got {text!r}.") from None
    if any(not s > 0 for s in speeds):
        raise ValueError(f"--speeds must all be positive, got {text!r}.")
    if text == DEFAULT_SPEEDS:  # the default adapts to --ranks; an explicit list must match
        return (speeds + [1.0] * ranks)[:ranks]
    if len(speeds) != ranks:
        raise ValueError(f"--speeds gives {len(speeds)} values but --ranks is {ranks}; give one speed per rank.")
    return speeds


def _stop(proc: subprocess.Popen[bytes], name: str, timeout: float) -> None:
    """SIGINT to the child's process group, then SIGKILL if it lingers (and say so)."""
    stop_process(proc, timeout, group=True, on_kill=lambda: print(
        f"rebalancer demo: {name} did not stop in {timeout:.0f}s; killing it.", file=sys.stderr))


def _summary(url: str, job: str) -> str:
    try:
        with urllib.request.urlopen(f"{url}/api/v1/jobs/{job}", timeout=5) as r:
            j = json.loads(r.read())
    except (OSError, ValueError):
        return "(no summary: the backend did not answer)"
    imb = j.get("imbalance")
    pl = j.get("placement") or {}
    return (f"job {job}: batch_index {j.get('batch_index')}, step {j.get('step_ms') or 0:.1f} ms, "
            f"imbalance {imb if imb is None else round(imb, 3)}, status {j.get('status')}, "
            f"placement v{pl.get('version')} {pl.get('shares')}")


def _sigterm_stops_like_ctrl_c() -> None:
    """``kill <pid>`` (a scheduler, a supervisor, a shell that left SIGINT ignored for a
    background job) stops the job and the backend as Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def run_demo(
    *, port: int = 8000, steps: int | None = None, ranks: int = 4, speeds: str = DEFAULT_SPEEDS,
    mode: str = "approve", global_batch_size: int = 64, per_sample_ms: float = 2.0,
    db: str | None = None, job: str = "demo", exit_when_done: bool = False,
) -> int:
    """Run the demo; returns the exit status (0 when ``steps`` completed or on Ctrl-C)."""
    try:
        if ranks < 1 or ranks > 64:
            raise ValueError(f"--ranks must be between 1 and 64, got {ranks}.")
        if steps is not None and steps < 1:
            raise ValueError(f"--steps must be at least 1, got {steps}.")
        speed_list = _speeds(speeds, ranks)
        if global_batch_size < ranks:
            raise ValueError(f"--global-batch-size ({global_batch_size}) must be at least --ranks ({ranks}).")
    except ValueError as exc:
        print(f"rebalancer demo: {exc}", file=sys.stderr)
        return 2
    if not port_free(port):
        new = free_port()
        print(f"rebalancer demo: port {port} is busy; using {new} instead.")
        port = new
    _sigterm_stops_like_ctrl_c()
    workdir = Path(tempfile.mkdtemp(prefix="rebalancer-demo-"))
    db = db or f"sqlite:///{workdir / 'rebalancer.db'}"
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "REBALANCER_DEFAULT_MODE": mode}
    env.pop("REBALANCER_ADMIN_TOKEN", None)  # loopback open mode: the demo needs no tokens
    server_log = workdir / "server.log"
    server = spawn_backend(port=port, db_url=db, log_path=server_log, env=env, new_session=True)
    job_proc: subprocess.Popen[bytes] | None = None
    interrupted = False
    try:
        failed = wait_healthy(url, server, 60.0)
        if failed:
            print(f"rebalancer demo: {failed}; its log:\n{server_log.read_text(errors='replace')}",
                  file=sys.stderr)
            return 1
        print(f"Rebalancer backend: {url}  (mode {mode}, log {server_log})")
        print(f"Dashboard:          {url}/job/{job}")
        print(f"Starting a {ranks}-rank CPU job with speeds {','.join(f'{s:g}' for s in speed_list)}"
              f"{f' for {steps} steps' if steps else '; Ctrl-C stops everything'}.", flush=True)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ranks),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "trainer_hook.demo_worker", "--server", url, "--job", job, "--steps", str(steps or 0),
            "--global-batch-size", str(global_batch_size), "--speeds", ",".join(map(str, speed_list)),
            "--per-sample-ms", str(per_sample_ms),
        ]
        job_env = {**env, "OMP_NUM_THREADS": "1"}
        job_proc = subprocess.Popen(cmd, env=job_env, start_new_session=True)
        code = job_proc.wait()
        print(_summary(url, job))
        if code != 0:
            print(f"rebalancer demo: the training job exited with {code}.", file=sys.stderr)
            return 1
        if exit_when_done:
            return 0
        print(f"The job finished. The backend and its page stay up: {url}/job/{job}\n"
              f"Press Ctrl-C to stop the backend.", flush=True)
        while server.poll() is None:
            time.sleep(0.5)
        print(f"rebalancer demo: the backend exited with {server.returncode}; its log: {server_log}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        interrupted = True
        running = job_proc is not None and job_proc.poll() is None
        print(f"\nrebalancer demo: stopping {'the job and ' if running else ''}the backend...", flush=True)
        return 0
    finally:
        if job_proc is not None:
            _stop(job_proc, "the training job", 20.0)
        if interrupted and server.poll() is None:
            print(_summary(url, job))
        _stop(server, "the backend", 15.0)
        print("rebalancer demo: stopped.")

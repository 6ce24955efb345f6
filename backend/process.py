"""``rebalancer serve`` as a child process: start it, wait until it answers, stop it.

``rebalancer demo``, the benchmarks and the test suite all run the real backend this
way, on a loopback port with its own database and log file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

from rebalancer_wire.ports import free_port, port_free

__all__ = ["free_port", "port_free", "spawn_backend", "start_backend", "wait_healthy", "stop_process",
           "on_parent_gone", "BackendStartError", "ADDRESS_IN_USE", "BIND_TRIES"]

ADDRESS_IN_USE = "address already in use"  # uvicorn's log line when its bind fails
BIND_TRIES = 3  # start_backend's tries on ports it picked


def on_parent_gone(parent: int, then: Callable[[], None], *, every_s: float = 0.5) -> None:
    """Call ``then()`` on a daemon thread once ``parent`` is no longer this process's parent
    (it exited, or was killed with SIGKILL and ran no cleanup of its children)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        then()

    threading.Thread(target=watch, name="rebalancer-parent-watch", daemon=True).start()


def spawn_backend(
    *,
    port: int,
    db_url: str,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    new_session: bool = False,
    cwd: str | Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``python -m backend serve`` with its output in ``log_path``; returns at once.

    ``env`` replaces the environment (PYTHONUNBUFFERED is added so the log is live);
    ``new_session`` puts the server in its own process group (for ``stop_process(group=True)``).
    The server stops by itself when the calling process is gone (REBALANCER_EXIT_WITH_PARENT).
    """
    # The backend lives as long as the caller: it stops by itself if the caller is killed.
    full_env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1",
                "REBALANCER_EXIT_WITH_PARENT": str(os.getpid())}
    cmd = [sys.executable, "-m", "backend", "serve", "--host", host, "--port", str(port), "--db", db_url]
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=new_session, cwd=cwd,
        )


class BackendStartError(RuntimeError):
    """The backend did not become healthy: ``why`` in words, ``log`` its output."""

    def __init__(self, why: str, log: str):
        super().__init__(f"{why}:\n{log}")
        self.why, self.log = why, log


def start_backend(
    *,
    db_url: str | Callable[[int], str],
    log_path: Callable[[int], Path],
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    new_session: bool = False,
    cwd: str | Path | None = None,
    timeout: float = 60.0,
) -> tuple[int, subprocess.Popen[bytes], Path]:
    """``spawn_backend`` and ``wait_healthy`` in one: the port, the running process and its log.

    Without ``port``, a free one (``free_port``); if another process binds it between the
    pick and the server's own bind (an outgoing connection, another test's server), the
    server starts again on another, ``BIND_TRIES`` in all. ``db_url`` and ``log_path`` may
    depend on the port. Raises ``BackendStartError`` (why, and the log) when the backend does
    not become healthy; it is stopped then."""
    for attempt in range(1, BIND_TRIES + 1):
        chosen = port or free_port()
        log = log_path(chosen)
        db = db_url(chosen) if callable(db_url) else db_url
        proc = spawn_backend(port=chosen, db_url=db, log_path=log, env=env, new_session=new_session, cwd=cwd)
        failed = wait_healthy(f"http://127.0.0.1:{chosen}", proc, timeout)
        if failed is None:
            return chosen, proc, log
        stop_process(proc, 10.0, group=new_session)
        text = log.read_text(errors="replace") if log.exists() else ""
        if port is None and attempt < BIND_TRIES and ADDRESS_IN_USE in text:
            continue
        raise BackendStartError(failed, text)
    raise AssertionError("unreachable")  # the last try returns or raises


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> str | None:
    """Poll ``url``/healthz until it answers 200. Returns None when it did, else why not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the backend exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1) as r:
                if r.status == 200:
                    return None
        except OSError:
            time.sleep(0.1)
    return f"the backend did not become healthy in {timeout:g}s"


def stop_process(
    proc: subprocess.Popen[bytes], timeout: float, *, group: bool = False,
    on_kill: Callable[[], None] | None = None,
) -> None:
    """SIGINT (to the process group with ``group``), then SIGKILL if it outlives ``timeout``.

    ``on_kill`` is called before the SIGKILL (to say so). Idempotent.
    """
    if proc.poll() is not None:
        return

    def signal_it(sig: signal.Signals) -> None:
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass

    signal_it(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        if on_kill is not None:
            on_kill()
        signal_it(signal.SIGKILL)
        proc.wait()

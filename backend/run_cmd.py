"""``rebalancer run [--server URL] [--job NAME] -- COMMAND ...``: zero-code monitoring.

Runs COMMAND unchanged (``torchrun ... train.py``, ``accelerate launch ...``, ``python
train.py``) with ``trainer_hook/_site`` first on ``PYTHONPATH`` and ``REBALANCER_MONITOR=1``,
``REBALANCER_SERVER`` and ``REBALANCER_JOB`` in its environment (torchrun hands them to
every worker): each rank's steps and device metrics stream to the backend
(trainer_hook.zero_code). The backend is the one at ``--server`` if it answers, else one
started here on loopback for the command's lifetime; the job is put in observe mode.
The exit status is COMMAND's; when monitoring cannot start, COMMAND runs unmonitored.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["add_command", "run", "site_dir", "job_name_for", "follow_job"]

DEFAULT_SERVER = "http://127.0.0.1:8000"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "run", help="run a training command with monitoring injected (no code change)",
        usage="rebalancer run [--server URL] [--job NAME] [--global-batch-size N] [--keep-serving] "
              "-- COMMAND [ARG ...]",
        description="Run COMMAND (e.g. torchrun --nproc-per-node 4 train.py) unchanged, with every "
                    "rank's steps, data wait and device metrics streamed to the dashboard. Observe "
                    "only: rebalancing needs the hook in the script (docs/integrations.md).",
    )
    p.add_argument("--server", help=f"backend URL (default: REBALANCER_SERVER or {DEFAULT_SERVER}); "
                                    "started here on loopback if it does not answer")
    p.add_argument("--job", help="job name (default: REBALANCER_JOB, else the script's name and the time)")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step over all ranks (default: the first batch's size "
                        "times the world size)")
    p.add_argument("--keep-serving", action="store_true",
                   help="when this command started the backend, keep it (and the dashboard) up after "
                        "COMMAND ends, until Ctrl-C")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARG ...]")


def site_dir() -> str:
    """The directory whose ``sitecustomize`` starts monitoring in every process."""
    import trainer_hook

    return os.path.join(os.path.dirname(os.path.abspath(trainer_hook.__file__)), "_site")


def job_name_for(argv: list[str], now: float | None = None) -> str:
    """``train-1612`` for ``torchrun ... train.py``: the script (or ``-m`` module) and the time."""
    stem = "job"
    for i, a in enumerate(argv):
        if a.endswith(".py"):
            stem = Path(a).stem
            break
        if a == "-m" and i + 1 < len(argv):
            stem = argv[i + 1].rsplit(".", 1)[-1]
            break
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-") or "job"
    return f"{stem}-{time.strftime('%H%M%S', time.localtime(now))}"


def _say(msg: str) -> None:
    print(f"rebalancer run: {msg}", file=sys.stderr, flush=True)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
            return bool(r.status == 200)
    except (OSError, ValueError):
        return False


def _start_backend(url: str) -> tuple[str, subprocess.Popen[bytes], Path] | str:
    """A backend on loopback (the URL's port when free) in observe mode; or why not."""
    from backend.process import BackendStartError, port_free, start_backend

    parts = urllib.parse.urlsplit(url)
    port = parts.port if parts.hostname in _LOOPBACK and parts.port and port_free(parts.port) else None
    workdir = Path(tempfile.mkdtemp(prefix="rebalancer-run-"))
    db = os.environ.get("REBALANCER_DB") or f"sqlite:///{workdir / 'rebalancer.db'}"
    log_path = workdir / "server.log"
    env = {**os.environ, "REBALANCER_DEFAULT_MODE": "observe"}
    env.pop("REBALANCER_MONITOR", None)
    try:
        port, proc, _ = start_backend(db_url=db, log_path=lambda _port: log_path, port=port, env=env,
                                      new_session=True)
    except BackendStartError as exc:
        tail = exc.log.strip().splitlines()[-1:] or [""]
        return f"{exc.why} ({tail[0]}; log {log_path})"
    local = f"http://127.0.0.1:{port}"
    return local, proc, log_path


def _known_jobs(client: Any) -> set[str] | None:
    try:
        return {j["job"] for j in client.jobs()}
    except Exception:  # noqa: BLE001 - the backend is starting or restarting: ask again later
        return None


def follow_job(client: Any, job: str, before: set[str], stop: threading.Event, *, set_observe: bool,
               poll_s: float = 1.0) -> str | None:
    """Wait for the command's ranks to say hello; return the job name they report under.

    ``job`` is the name this command gave (REBALANCER_JOB); a script whose own hook names its
    own job reports under another, the first job the backend did not know ``before``: that
    name and its dashboard are printed. ``set_observe``: on a backend this command did not
    start, put ``job`` in observe mode once it exists (a script's own hook keeps its mode)."""
    from backend.client import APIError

    while True:
        stopping = stop.wait(poll_s)  # once more after the command ended: a short job
        names = _known_jobs(client)
        used = None
        if names is not None:
            new = sorted(names - before)
            used = job if job in names else (new[0] if new else None)
        if used is None:
            if stopping:
                return None
            continue
        if used != job:
            _say(f"the script reports as job '{used}' (it names its own job, not '{job}'): dashboard: "
                 f"{client.server}/job/{urllib.parse.quote(used)}")
            return used
        if set_observe:
            try:
                if client.job(job).get("mode") != "observe":
                    client.set_mode(job, "observe", reason="rebalancer run: monitoring without code change")
            except APIError as exc:
                _say(f"cannot set job '{job}' to observe mode ({exc.detail}); the ranks reject placements anyway")
            except Exception as exc:  # noqa: BLE001
                _say(f"cannot set job '{job}' to observe mode ({exc}); the ranks reject placements anyway")
        return used


def _start_follower(server: str, job: str, stop: threading.Event, *, set_observe: bool) -> threading.Thread | None:
    from backend.client import Client

    try:
        client = Client(server, os.environ.get("REBALANCER_TOKEN"))
    except ValueError as exc:
        _say(f"cannot follow the job: {exc}")
        return None
    before = (_known_jobs(client) or set()) - {job}
    t = threading.Thread(target=follow_job, args=(client, job, before, stop), kwargs={"set_observe": set_observe},
                         daemon=True)
    t.start()
    return t


def _run_child(argv: list[str], env: dict[str, str]) -> int:
    """COMMAND in the foreground; SIGINT reaches it from the terminal, SIGTERM is passed on."""
    try:
        child = subprocess.Popen(argv, env=env)
    except OSError as exc:
        _say(f"cannot start {argv[0]!r}: {exc}")
        return 127 if isinstance(exc, FileNotFoundError) else 126

    def forward(signum: int, _frame: Any) -> None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    old_term = signal.signal(signal.SIGTERM, forward)
    old_int = signal.signal(signal.SIGINT, lambda *_: None)  # the child has it too; wait for it
    try:
        rc = child.wait()
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
    return 128 - rc if rc < 0 else rc


def run(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        _say("give the command to run after --, e.g. rebalancer run -- torchrun --nproc-per-node 2 train.py")
        return 2
    if args.global_batch_size is not None and not 1 <= args.global_batch_size <= 1 << 31:
        _say(f"--global-batch-size must be between 1 and 2**31, got {args.global_batch_size}")
        return 2
    server = (args.server or os.environ.get("REBALANCER_SERVER") or DEFAULT_SERVER).strip().rstrip("/")
    job = args.job or os.environ.get("REBALANCER_JOB") or job_name_for(argv)
    if any(c in job for c in "/?#\\") or job != job.strip() or not job:
        _say(f"--job may not be empty nor contain '/', '?', '#', '\\' or surrounding spaces, got {job!r}")
        return 2
    env = dict(os.environ)
    backend: subprocess.Popen[bytes] | None = None
    stop = threading.Event()
    monitored = True
    watcher: threading.Thread | None = None
    ours = False
    if not _answers(server):
        try:
            started = _start_backend(server)
        except Exception as exc:  # noqa: BLE001 - run the command anyway
            started = f"{type(exc).__name__}: {exc}"
        if isinstance(started, str):
            _say(f"no backend at {server} and none could be started ({started}); running the command "
                 "unmonitored")
            monitored = False
        else:
            server, backend, log_path = started
            ours = True
            _say(f"started a backend at {server} (observe mode, log {log_path})")
    if monitored:
        watcher = _start_follower(server, job, stop, set_observe=not ours)
        previous = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = site_dir() + (os.pathsep + previous if previous else "")
        env.update({"REBALANCER_MONITOR": "1", "REBALANCER_SERVER": server, "REBALANCER_JOB": job})
        if args.global_batch_size is not None:
            env["REBALANCER_GLOBAL_BATCH_SIZE"] = str(args.global_batch_size)
        _say(f"dashboard: {server}/job/{urllib.parse.quote(job)}")
    rc: int | None = None
    try:
        rc = _run_child(argv, env)
        if backend is not None and args.keep_serving:
            _say(f"the command exited with status {rc}; the backend stays up at "
                 f"{server}/job/{urllib.parse.quote(job)} until Ctrl-C")
            signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                backend.wait()
            except KeyboardInterrupt:
                pass
    finally:
        stop.set()
        if watcher is not None:
            watcher.join(timeout=15)
        if backend is not None:
            from backend.process import stop_process

            stop_process(backend, 10.0, group=True)
    return rc

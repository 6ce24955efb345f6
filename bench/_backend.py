"""A real backend process for benchmarks, and the few REST calls they make."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.process import free_port, spawn_backend, start_backend, stop_process, wait_healthy

__all__ = ["ApiError", "Backend", "REPO_ROOT", "free_port", "running_backend", "running_cluster", "stop_on_sigterm"]

REDIS_URL = "redis://127.0.0.1:6379/0"

REPO_ROOT = Path(__file__).resolve().parent.parent


def stop_on_sigterm() -> None:
    """Make SIGTERM (``timeout``, a CI runner) unwind like Ctrl-C, so that every backend and
    job a benchmark started is stopped by its ``finally`` instead of being orphaned."""

    def _raise(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _raise)


class ApiError(RuntimeError):
    """A REST call answered with an error status."""

    def __init__(self, method: str, path: str, status: int, body: str):
        super().__init__(f"{method} {path} answered {status}: {body[:300]}")
        self.status = status
        self.body = body


@dataclass
class Backend:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def request(self, method: str, path: str, body: Any = None, *, timeout: float = 15.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            raise ApiError(method, path, exc.code, exc.read().decode(errors="replace")) from None
        ctype = r.headers.get("Content-Type", "")
        if "json" in ctype:
            return json.loads(raw)
        return raw.decode(errors="replace")

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def put(self, path: str, body: Any) -> Any:
        return self.request("PUT", path, body)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, body if body is not None else {})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def running_backend(
    workdir: Path | None = None, *, env: dict[str, str] | None = None, timeout: float = 60.0
) -> Iterator[Backend]:
    """Start ``python -m backend serve`` on a free loopback port with a fresh SQLite file,
    wait for /healthz, yield it, and stop it (SIGINT, then SIGKILL). A port taken between the
    pick and the bind means another (``backend.process.start_backend``)."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rb-bench-")))
        wd = workdir
        port, proc, log_path = start_backend(db_url=lambda p: f"sqlite:///{wd / f'bench-{p}.db'}",
                                             log_path=lambda p: wd / f"backend-{p}.log",
                                             env={**os.environ, **(env or {})}, cwd=REPO_ROOT, timeout=timeout)
        backend = Backend(url=f"http://127.0.0.1:{port}", port=port, proc=proc, log_path=log_path)
        try:
            yield backend
        finally:
            stop_process(proc, 10.0)


@contextlib.contextmanager
def running_cluster(
    replicas: int, *, redis_url: str = REDIS_URL, env: dict[str, str] | None = None, timeout: float = 90.0,
) -> Iterator[list[Backend]]:
    """``replicas`` backend processes sharing the local PostgreSQL (a fresh schema, dropped on
    exit: ``tests.helpers.postgres.pg_schema``) and one Redis (a key prefix of their own,
    deleted on exit), as docs/scale-out.md runs them; each advertises its own loopback URL."""
    import uuid

    import redis

    from tests.helpers.postgres import pg_schema

    name = f"bench_{uuid.uuid4().hex[:10]}"
    client = redis.Redis.from_url(redis_url)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with pg_schema() as db_url, tempfile.TemporaryDirectory(prefix="rb-bench-cluster-") as tmp:
            try:
                backends = []
                for _ in range(replicas):
                    port = free_port()
                    log_path = Path(tmp) / f"backend-{port}.log"
                    proc = spawn_backend(port=port, db_url=db_url, log_path=log_path, cwd=REPO_ROOT, env={
                        **os.environ, **(env or {}), "REBALANCER_REDIS_URL": redis_url,
                        "REBALANCER_REDIS_PREFIX": name, "REBALANCER_ADVERTISE_URL": f"ws://127.0.0.1:{port}",
                    })
                    procs.append(proc)
                    backends.append(Backend(url=f"http://127.0.0.1:{port}", port=port, proc=proc, log_path=log_path))
                    if len(backends) == 1:  # the first creates the tables; the others find them
                        failed = wait_healthy(backends[0].url, proc, timeout)
                        if failed:
                            raise RuntimeError(f"{failed}:\n{backends[0].log()}")
                for b in backends[1:]:
                    failed = wait_healthy(b.url, b.proc, timeout)
                    if failed:
                        raise RuntimeError(f"{failed}:\n{b.log()}")
                yield backends
            finally:  # the replicas stop before their schema is dropped
                for proc in procs:
                    stop_process(proc, 10.0)
    finally:
        for key in client.scan_iter(f"{name}:*"):
            client.delete(key)
        client.close()

"""Run the real backend (`python -m backend serve`) as a uvicorn process on a free port."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers.ports import free_port


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    port: int
    db_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://")

    def get(self, path: str, token: str | None = None) -> object:
        req = urllib.request.Request(self.url + path)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def call(self, method: str, path: str, token: str | None = None, body: object = None) -> tuple[int, Any]:
        """One REST call; returns (status, decoded JSON body), error statuses included."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"backend exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"backend did not become healthy in {timeout}s:\n{log_path.read_text()}")


@contextlib.contextmanager
def running_server(
    tmp_path: Path,
    *,
    db_url: str | None = None,
    port: int | None = None,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    timeout: float = 30.0,
) -> Iterator[Server]:
    """Start the backend, wait for /healthz, yield it, stop it (SIGINT, then SIGKILL)."""
    port = port or free_port()
    db_url = db_url or f"sqlite:///{tmp_path / 'rebalancer.db'}"
    log_path = tmp_path / f"server-{port}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "backend", "serve", "--host", "127.0.0.1", "--port", str(port), "--db", db_url]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log_path, timeout)
        yield Server(url=url, port=port, db_url=db_url, proc=proc, log_path=log_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

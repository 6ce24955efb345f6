"""Run the real backend (`python -m backend serve`) as a uvicorn process on a free port."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.process import start_backend, stop_process


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


@contextlib.contextmanager
def running_server(
    tmp_path: Path,
    *,
    db_url: str | None = None,
    port: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> Iterator[Server]:
    """Start the backend, wait for /healthz, yield it, stop it (SIGINT, then SIGKILL).

    Without ``port``, a free one; if another process binds it first (between the pick and
    the server's bind), the server starts again on another (``BIND_TRIES`` in all)."""
    db_url = db_url or f"sqlite:///{tmp_path / 'rebalancer.db'}"
    chosen, proc, log_path = start_backend(db_url=db_url, log_path=lambda p: tmp_path / f"server-{p}.log",
                                           port=port, env={**os.environ, **(env or {})}, timeout=timeout)
    try:
        yield Server(url=f"http://127.0.0.1:{chosen}", port=chosen, db_url=db_url, proc=proc, log_path=log_path)
    finally:
        stop_process(proc, 10.0)

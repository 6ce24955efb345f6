"""Run Debian's Prometheus (``/usr/bin/prometheus``) on a free loopback port with a given
config, and query its HTTP API."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from backend.process import free_port, stop_process
from tests.helpers.waiting import wait_until

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
INSTALL_HINT = "Debian's prometheus package is missing; `make prometheus` (part of `make test`) installs it."


def installed() -> bool:
    return Path(PROMETHEUS).is_file() and Path(PROMTOOL).is_file()


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/PATH; returns ``data`` (raises with Prometheus's error otherwise)."""
        url = f"{self.url}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read())
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus refused {path} {params}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        return self.api("query", query=promql)["result"]  # type: ignore[no-any-return]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def running_prometheus(tmp: Path, config: dict[str, Any]) -> Iterator[Prometheus]:
    """Write ``config``, start Prometheus on a free port, wait until it is ready, stop it."""
    cfg = tmp / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    log_path = tmp / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {proc.returncode}:\n{prom.log()}")
            try:
                with urllib.request.urlopen(prom.url + "/-/ready", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(ready, "Prometheus to be ready", 30, log=prom.log)
        yield prom
    finally:
        stop_process(proc, 10.0)

"""`rebalancer demo --steps 30`: backend plus a real 4-rank job, ends by itself, exits 0."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.helpers.ports import free_port
from tests.helpers.torchrun import REPO_ROOT


@pytest.mark.multiproc
def test_demo_runs_to_the_end_and_cleans_up():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REBALANCER_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT)
    proc = subprocess.run([sys.executable, "-m", "backend", "demo", "--steps", "30", "--port", str(port)],
                          capture_output=True, text=True, timeout=240, cwd=REPO_ROOT, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"Dashboard:          http://127.0.0.1:{port}/job/demo" in proc.stdout
    assert "job demo: batch_index 29" in proc.stdout, out  # the summary read back over REST
    assert "rebalancer demo: stopped." in proc.stdout
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):  # the backend is gone
        s.connect(("127.0.0.1", port))


def test_demo_refuses_mismatched_speeds(capsys):
    from backend.cli import main

    assert main(["demo", "--ranks", "2", "--speeds", "1,1,0.5"]) == 2
    assert capsys.readouterr().err == (
        "rebalancer demo: --speeds gives 3 values but --ranks is 2; give one speed per rank.\n")


@pytest.mark.multiproc
def test_demo_stops_everything_on_ctrl_c():
    import signal
    import time
    import urllib.request
    import uuid

    import psutil

    port, job = free_port(), f"demo-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REBALANCER_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend", "demo", "--port", str(port), "--ranks", "2", "--job", job],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, env=env,
    )
    try:
        deadline = time.monotonic() + 120
        seen = 0
        while time.monotonic() < deadline and seen < 5:  # wait until the job streams steps
            time.sleep(1)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/jobs/{job}", timeout=2) as r:
                    seen = int(json.loads(r.read()).get("batch_index") or 0)
            except OSError:
                pass
        assert seen >= 5, "the demo job never reported steps"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "stopping the job and the backend" in out and "rebalancer demo: stopped." in out
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if job in " ".join(p.info["cmdline"] or [])]
    assert left == [], out
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))

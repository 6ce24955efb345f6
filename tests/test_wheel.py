"""A plain (non-editable) install serves the dashboard: build the wheel, install it into a
fresh venv, and load ``/`` and a static file from the installed package data."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_CHECK = """
import backend, sys
from pathlib import Path
from fastapi.testclient import TestClient
from backend.main import create_app
from backend.settings import Settings
assert Path(backend.__file__).is_relative_to(Path(sys.prefix)), backend.__file__
app = create_app(Settings(db="sqlite:///" + sys.argv[1], gc_freeze=False))
with TestClient(app) as c:
    page, js = c.get("/"), c.get("/static/js/overview.js")
    assert page.status_code == 200 and "<html" in page.text.lower(), page.text[:200]
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
print("served from", backend.__file__)
"""


@pytest.mark.install
def test_the_wheel_serves_the_dashboard_from_a_fresh_venv(tmp_path: Path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(ROOT)], check=True, cwd=tmp_path)
    wheel = next(dist.glob("rebalancer-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
                    str(wheel)], check=True)
    # The server's dependencies come from this venv (no network): appended after the fresh
    # venv's own site-packages, so `backend` is the installed wheel, not this source tree.
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    out = subprocess.run([str(py), "-c", _CHECK, str(tmp_path / "r.db")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"served from {site}" in out.stdout

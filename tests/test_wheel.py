"""A plain (non-editable) install serves the dashboard: build the wheel, check that the
top-level ``frontend`` package carries every page, script and stylesheet, install it into a
fresh venv, and load ``/``, ``/job/NAME`` and static files from the installed package data."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_CHECK = """
import backend, frontend, sys
from pathlib import Path
from fastapi.testclient import TestClient
from backend.api.routes.pages import FRONTEND_DIR
from backend.main import create_app
from backend.settings import Settings
for module in (backend, frontend):
    assert Path(module.__file__).is_relative_to(Path(sys.prefix)), module.__file__
assert FRONTEND_DIR == Path(frontend.__file__).parent, FRONTEND_DIR
app = create_app(Settings(db="sqlite:///" + sys.argv[1], gc_freeze=False))
with TestClient(app) as c:
    page, job, js, css = (c.get("/"), c.get("/job/x"), c.get("/static/js/overview.js"),
                          c.get("/static/css/app.css"))
    for got in (page, job):
        assert got.status_code == 200 and "<html" in got.text.lower(), got.text[:200]
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
print("served from", FRONTEND_DIR)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(ROOT)], check=True, cwd=dist)
    return next(dist.glob("torch_rebalancer-*.whl"))


@pytest.mark.install
def test_the_wheel_carries_the_frontend_package(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    source = ROOT / "frontend"
    files = sorted(p.relative_to(ROOT).as_posix() for p in source.rglob("*")
                   if p.is_file() and p.suffix in (".py", ".html", ".js", ".css"))
    assert {"frontend/__init__.py", "frontend/index.html", "frontend/job.html",
            "frontend/css/app.css", "frontend/js/overview.js", "frontend/js/job.js"} <= set(files)
    assert set(files) - names == set(), "files of frontend/ missing from the wheel"
    assert not [n for n in names if n.startswith("backend/frontend/")]


@pytest.mark.install
def test_the_wheel_serves_the_dashboard_from_a_fresh_venv(wheel: Path, tmp_path: Path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
                    str(wheel)], check=True)
    # The server's dependencies come from this venv (no network): appended after the fresh
    # venv's own site-packages, so `backend` and `frontend` are the installed wheel, not
    # this source tree.
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    out = subprocess.run([str(py), "-c", _CHECK, str(tmp_path / "r.db")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"served from {site}/frontend" in out.stdout

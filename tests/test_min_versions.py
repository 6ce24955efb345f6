"""The lower bounds of pyproject.toml are versions that work: a fresh venv gets each declared
minimum of the runtime extras (where the index has it; otherwise the oldest release above
it), and the tests that drive the real server, a real torchrun job, the client and the CLI
pass there.

Slow (installs from the index: about 2 minutes, then 1 to 2 minutes of tests), so opt-in:
``make check-min-versions`` (REBALANCER_CHECK_MIN_VERSIONS=1). torch is the exception: it
is installed at the version here (2.13.0, CPU, from local disk); older builds on the index
pull CUDA wheels of several GB.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("hook", "server", "client")
NOT_PINNED = {"torch"}
# Test tools at their own declared minimum where a newer one breaks an older runtime
# dependency (httpx 0.28 removed the `app` argument starlette < 0.41's TestClient passes).
TOOLS = ["pytest>=8", "pytest-timeout>=2.2", "httpx==0.27.0", "pyyaml>=6"]
# Integration tests: the real uvicorn server, a real torchrun job, the client, the CLI and
# the dashboard websocket, tokens, storage, Prometheus exposition.
TESTS = ["tests/backend/test_client.py", "tests/backend/test_auth.py", "tests/backend/test_jobs_api.py",
         "tests/backend/test_e2e_ingest.py", "tests/test_compose.py"]

pytestmark = [
    pytest.mark.multiproc, pytest.mark.timeout(900),
    pytest.mark.skipif(os.environ.get("REBALANCER_CHECK_MIN_VERSIONS") != "1",
                       reason="slow, installs from the index: make check-min-versions"),
]


def lower_bounds() -> dict[str, str]:
    """Package name (extras dropped) -> its declared lower bound, over the runtime extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out: dict[str, str] = {}
    for extra in EXTRAS:
        for req in project["optional-dependencies"][extra]:
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)", req.split(";")[0].strip())
            assert m, f"{req!r} in [{extra}] has no plain lower bound"
            name = m.group(1).lower()
            assert out.get(name, m.group(3)) == m.group(3), f"{name} has two lower bounds"
            out[name] = m.group(3)
    return out


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:4])


def oldest_available(pip: Path, name: str, bound: str) -> str:
    got = subprocess.run([str(pip), "index", "versions", name], capture_output=True, text=True, timeout=120)
    line = next((ln for ln in got.stdout.splitlines() if ln.startswith("Available versions:")), "")
    versions = [v.strip() for v in line.split(":", 1)[-1].split(",") if v.strip()]
    ok = [v for v in versions if _version_key(v) >= _version_key(bound)]
    assert ok, f"no release of {name} >= {bound} on the index: {got.stdout} {got.stderr}"
    return min(ok, key=_version_key)


def test_declared_minimums_work(tmp_path: Path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip, python = venv / "bin" / "pip", venv / "bin" / "python"
    pins = {name: oldest_available(pip, name, bound) for name, bound in lower_bounds().items()
            if name not in NOT_PINNED}
    if "psycopg" in pins:
        pins["psycopg-binary"] = pins["psycopg"]
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    print("installing:", ", ".join(f"{n}=={v}" for n, v in sorted(pins.items())))
    got = subprocess.run([str(pip), "install", "-q", "-c", str(constraints), "torch==2.13.0",
                          "-e", f".[{','.join(EXTRAS)}]", *TOOLS], cwd=ROOT, capture_output=True, text=True)
    assert got.returncode == 0, got.stdout + got.stderr
    listed = subprocess.run([str(pip), "freeze"], capture_output=True, text=True).stdout.lower()
    for name, version in pins.items():
        assert f"{name}=={version}" in listed.replace("_", "-"), f"{name} is not at {version}:\n{listed}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REBALANCER_")}
    tests = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                           cwd=ROOT, capture_output=True, text=True, env=env)
    assert tests.returncode == 0, tests.stdout[-6000:] + tests.stderr[-3000:]

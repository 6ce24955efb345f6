"""Shared fixtures: an in-process app client with tokens, and a real backend server.

Builders live in ``tests/helpers/`` (apps and hook frames in ``tests/backend/_app.py``, the
one polling helper ``wait_until`` in ``tests/helpers/waiting.py``); fixtures that several
test files use live here.

- ``admin``: the bootstrap admin token's secret.
- ``app_client``: a ``TestClient`` over an in-process app on a fresh SQLite file, with
  ``admin`` as its bootstrap token (lifespan running).
- ``tokens``: ``tokens("viewer")`` creates a token of that role over REST, returns its secret.
- ``server``: the real backend (``python -m backend serve``) on a free loopback port.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

# The cyclic-GC freeze is for a long-lived server: tests build hundreds of apps in one process.
os.environ.setdefault("REBALANCER_GC_FREEZE", "0")

ADMIN = "admin-secret-0123456789abcdef"


@pytest.fixture
def admin() -> str:
    return ADMIN


@pytest.fixture
def app_client(tmp_path: Path) -> Iterator[TestClient]:
    from tests.backend._app import make_app

    with TestClient(make_app(tmp_path, admin_token=ADMIN)) as c:
        yield c


@pytest.fixture
def tokens(app_client: TestClient) -> Callable[..., str]:
    def make(role: str, job: str | None = None, name: str = "") -> str:
        r = app_client.post("/api/v1/tokens", json={"role": role, "job": job, "name": name},
                            headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 201, r.text
        secret: str = r.json()["secret"]
        return secret

    return make


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    from tests.helpers.server import running_server

    with running_server(tmp_path, env={"REBALANCER_ADMIN_TOKEN": ADMIN}) as srv:
        yield srv


@pytest.fixture(autouse=True, scope="session")
def _native_comm_hook_built() -> None:
    """Build the C++ DDP comm hook once per test run (about 40 s of CPU on a cold cache),
    so that torchrun workers load it from the cache instead of each waiting on the build
    inside a test's timeout. The unit lane starts no compiler: its DDP tests use the
    Python hook unless the cache already has the library."""
    if os.environ.get("REBALANCER_UNIT_LANE") == "1":
        return
    try:
        from trainer_hook import _native_comm_hook
    except ImportError:  # an install without torch (the server image's test run)
        return
    _native_comm_hook.load()


@pytest.fixture(autouse=True)
def _unit_lane_spawns_nothing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``make test-unit`` (REBALANCER_UNIT_LANE=1) a test that starts a process fails
    and says which marker it lacks, so the fast lane stays free of processes."""
    if os.environ.get("REBALANCER_UNIT_LANE") != "1":
        return
    import subprocess

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{request.node.nodeid} starts a process; mark it multiproc (make test-unit runs none)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


# The test files known to be slow, roughly slowest first; re-measure with --durations (or the
# CPU time each file's processes take: scripts/test-cpu; the suite is CPU-bound on 2 cores).
# Issue 38: the short soak, the clean exits and the OpenAPI fuzz, then the files whose torchrun
# jobs cannot share a process (hook_backend's restarts and resumes, zero_code's unchanged
# scripts); test_sharded and test_exactness run one shared job each (compiled models and the
# Python comm hook included) besides their sync-wait and resume jobs; the Accelerate and HF
# Trainer files run 2 and 1 jobs. Under `--dist loadfile` a file runs whole on one worker, and xdist hands files out
# in order; by default it orders them by how many tests they hold, which leaves the long
# files with few tests to the end, where a worker may wait on one alone. Longest first
# instead (then the files with the most process-starting tests), so short files fill the end.
SLOW_FILES = (
    "tests/bench/test_soak.py",
    "tests/trainer_hook/test_clean_exit.py",
    "tests/backend/test_openapi_fuzz.py",
    "tests/trainer_hook/test_hook_backend.py",
    "tests/integrations/test_zero_code.py",
    "tests/trainer_hook/test_sharded.py",
    "tests/trainer_hook/test_exactness.py",
    "tests/integrations/test_lightning.py",
    "tests/trainer_hook/test_token_loss.py",
    "tests/trainer_hook/test_exit_abort.py",
    "tests/integrations/test_elastic.py",
    "tests/integrations/test_accelerate.py",
    "tests/integrations/test_hf_trainer.py",
)
_HEAVY_MARKS = ("multiproc", "browser", "install", "postgres")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order set below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    heavy: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        heavy[path] = heavy.get(path, 0) + any(item.get_closest_marker(m) for m in _HEAVY_MARKS)

    def key(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(SLOW_FILES)), -heavy[path]

    items.sort(key=key)  # stable: a file's tests keep their order

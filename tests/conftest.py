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


# The test files known to be slow, slowest first: the CPU seconds each file's processes take
# (scripts/test-cpu; the suite is CPU-bound on CI's 2 cores), re-measured for issue 38 after
# its merges: the short soak first (long in wall time, its hang check and spawned workers),
# then the files of 35 to 80 CPU-s (torchrun jobs that cannot share a process: restarts and
# resumes, zero_code's unchanged scripts, e2e_control's stories, the ends of a script;
# test_sharded, test_exactness and test_dp_mesh run one shared job each besides a resume),
# then 15 to 35 (test_zero_code about 58 since its reference is computed in process and its
# broken injections share a job, 5 torchrun jobs instead of 7; test_hf_trainer and
# test_accelerate about 3 less each, their refusals in process). Under
# `--dist loadfile` a file runs whole on one worker, and xdist hands files out in order; by
# default it orders them by how many tests they hold, which leaves the long files with few
# tests to the end, where a worker may wait on one alone. Longest first instead (then the
# files with the most process-starting tests), so that short files fill the end.
SLOW_FILES = (
    "tests/bench/test_soak.py",
    "tests/trainer_hook/test_hook_backend.py",
    "tests/integrations/test_zero_code.py",
    "tests/trainer_hook/test_sharded.py",
    "tests/backend/test_openapi_fuzz.py",
    "tests/trainer_hook/test_exactness.py",
    "tests/backend/test_e2e_control.py",
    "tests/trainer_hook/test_clean_exit.py",
    "tests/integrations/test_lightning.py",
    "tests/backend/test_client.py",
    "tests/browser/test_dashboard.py",
    "tests/integrations/test_hf_trainer.py",
    "tests/integrations/test_accelerate.py",
    "tests/trainer_hook/test_dp_mesh.py",
    "tests/trainer_hook/test_token_loss.py",
    "tests/integrations/test_elastic.py",
    "tests/trainer_hook/test_resume_measured_lookahead.py",
    "tests/backend/test_e2e_ingest.py",
    "tests/trainer_hook/test_exit_abort.py",
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

"""A job's starting mode (issue 39): preset before the job starts (REST and ``rebalancer
mode``), asked for in the hello (``RebalanceHook(mode=...)``), and ``rebalancer watch`` on a
job the backend does not know. In process: the real app on a SQLite file, hooks on real
/ws/hook websockets through TestClient, the CLI through a client that calls the same app."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from backend.cli import build_parser
from backend.client import commands
from backend.client.rest import APIError, Client, _detail
from backend.main import create_app
from backend.settings import Settings
from rebalancer_wire.protocol import Hello, Placement, ProtocolError, decode, encode

ADMIN = "preset-admin-secret-0123456789"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(db=f"sqlite:///{tmp_path / 'r.db'}", admin_token=ADMIN))) as c:
        yield c


@contextlib.contextmanager
def ranks(client: TestClient, job: str, *, world: int = 2, mode: str = "") -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for r in range(world):
            ws = stack.enter_context(client.websocket_connect(f"/ws/hook?token={ADMIN}"))
            ws.send_text(encode(Hello(job=job, rank=r, world_size=world, global_batch_size=8, mode=mode)))
            assert isinstance(decode(ws.receive_text()), Placement)
        yield


class AppClient(Client):
    """The CLI's client, its HTTP calls made on the app in process."""

    def __init__(self, app: TestClient) -> None:
        super().__init__("http://testserver", ADMIN)
        self.app = app

    def _send(self, method: str, path: str, *, params: Mapping[str, Any] | None = None, body: Any = None,
              accept: str) -> bytes:
        got = self.app.request(method, path, params=params, json=body, headers={**AUTH, "Accept": accept})
        if got.status_code >= 400:
            raise APIError(got.status_code, _detail(got.content, got.reason_phrase), method=method, path=path)
        return got.content


def cli(client: TestClient, *argv: str) -> tuple[int, str, str]:
    args = build_parser().parse_args(list(argv))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), pytest.MonkeyPatch.context() as mp:
        mp.setattr(commands, "Client", lambda *a, **k: AppClient(client))
        rc = commands.run(args, out)
    return rc, out.getvalue(), err.getvalue()


def mode_of(client: TestClient, job: str) -> str:
    return client.get(f"/api/v1/jobs/{job}", headers=AUTH).json()["mode"]  # type: ignore[no-any-return]


def test_a_mode_set_before_the_job_starts_is_stored_as_a_preset_and_applied_at_its_first_hello(client):
    got = client.put("/api/v1/jobs/later/mode", json={"mode": "auto", "reason": "start in auto"}, headers=AUTH)
    assert got.status_code == 200, got.text
    assert got.json() == {"job": "later", "mode": "auto", "preset": True,
                          "detail": "Job 'later' has not started yet: mode auto is stored as a preset and applies "
                                    "when its first rank connects."}
    with ranks(client, "later"):
        assert mode_of(client, "later") == "auto"
    audit = client.get("/api/v1/jobs/later/audit", headers=AUTH).json()["data"]
    assert [(a["action"], a["params"].get("mode")) for a in audit][-2:] == [("job.create", "auto"),
                                                                              ("job.mode_preset", "auto")]
    # Known now: the mode is set as before, no preset.
    got = client.put("/api/v1/jobs/later/mode", json={"mode": "observe"}, headers=AUTH)
    assert got.status_code == 200 and got.json()["mode"] == "observe" and "preset" not in got.json()
    bad = client.put("/api/v1/jobs/other/mode", json={"mode": "fast"}, headers=AUTH)
    assert (bad.status_code, bad.json()["detail"]) == (422, "Mode must be one of observe, approve, auto; got 'fast'.")


def test_the_hello_asks_for_a_starting_mode_and_an_operators_preset_wins(client):
    with ranks(client, "hooked", mode="observe"):
        assert mode_of(client, "hooked") == "observe"
    with ranks(client, "plain"):
        assert mode_of(client, "plain") == "approve"  # the backend's default
    client.put("/api/v1/jobs/preset/mode", json={"mode": "approve"}, headers=AUTH)
    with ranks(client, "preset", mode="auto"):
        assert mode_of(client, "preset") == "approve"
    with ranks(client, "plain", mode="auto"):  # a job already seen keeps its mode
        assert mode_of(client, "plain") == "approve"
    with pytest.raises(ProtocolError, match=r"'mode' must be one of observe, approve, auto \(or absent\), got 'fast'"):
        Hello.from_dict({"job": "j", "rank": 0, "world_size": 1, "global_batch_size": 1, "mode": "fast"})


def test_rebalancer_mode_on_a_job_not_seen_yet_says_it_is_a_preset(client):
    rc, out, err = cli(client, "mode", "tomorrow", "auto")
    assert (rc, err) == (0, "")
    assert out == ("Job tomorrow has not started yet: mode auto is preset and applies when its first rank "
                   "connects.\n")
    with ranks(client, "tomorrow"):
        rc, out, _ = cli(client, "mode", "tomorrow", "observe")
        assert (rc, out) == (0, "Job tomorrow is now in observe mode.\n")


def test_rebalancer_watch_on_an_unknown_job_says_so_and_names_the_known_ones(client):
    rc, _, err = cli(client, "watch", "nobody")
    assert rc == commands.EXIT_REFUSED
    assert err == ("rebalancer watch: Job 'nobody' not found (the backend has no jobs yet; `rebalancer jobs` lists "
                   "them). To wait for a job that has not started yet, pass --wait. (HTTP 404)\n")
    with ranks(client, "train-a"), ranks(client, "train-b"):
        rc, _, err = cli(client, "watch", "train-c")
    assert rc == commands.EXIT_REFUSED and "(known jobs: train-a, train-b; `rebalancer jobs` lists them)" in err, err

"""The hostile corpus against /ws/hook and /ws/dashboard while a real job trains (issue 15).

A real backend with tokens, a real 2-rank torchrun/gloo job streaming to it, and every
hostile input the issue lists plus floods, sent from other connections while the job runs:
each gets its close code, the backend never crashes (no traceback, /healthz ok), and the
job's live and stored metrics are whole: every rank's every batch, nothing reset.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.backend._app import hello
from tests.helpers.server import Server, running_server
from tests.helpers.torchrun import running_torchrun
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

ADMIN = "admin-" + secrets.token_urlsafe(24)
JOB = "steady"
STEPS = 800


def step(**over: Any) -> dict[str, Any]:
    rec = {"batch_index": 0, "local_batch_size": 4, "placement_version": 0, "data_wait_ms": 0.1,
           "compute_ms": 1.0, "sync_wait_ms": 0.1, "optimizer_ms": 0.1, "step_ms": 1.5, "t": time.time()}
    return {**rec, **over}


def metrics(job: str, **over: Any) -> str:
    return json.dumps({"type": "metrics", "v": 1, "job": job, "rank": 0, "steps": [], "device": [],
                       "dropped": 0, **over}, separators=(",", ":"))


def close_code(url: str, frames: list[str], token: str | None, *, read_s: float = 15.0) -> int | None:
    """Open ``url``, send ``frames`` (stopping when closed), return the close code."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with connect(url, additional_headers=headers, max_size=None) as ws:
        with contextlib.suppress(ConnectionClosed):
            for f in frames:
                ws.send(f)
        deadline = time.monotonic() + read_s
        try:
            while time.monotonic() < deadline:
                ws.recv(timeout=read_s)
        except (ConnectionClosed, TimeoutError) as exc:
            if isinstance(exc, ConnectionClosed):
                return exc.rcvd.code if exc.rcvd is not None else None
    return None


def corpus(evil: str, real: str) -> list[tuple[str, str, list[str], str | None, int]]:
    """(name, path, frames, token, expected close code)."""
    h = hello(job="evil", rank=0, world_size=1, global_batch_size=8)

    def bad(**over: Any) -> list[str]:
        return [h, metrics("evil", steps=[step(**over)])]

    shape = json.loads(hello(job="evil", rank=0, world_size=1, global_batch_size=8))
    return [
        ("t=1e308", "/ws/hook", bad(t=1e308), evil, 4002),
        ("t=NaN", "/ws/hook", [h, metrics("evil", steps=[step(t=0.5)]).replace('"t":0.5', '"t":NaN')], evil, 4002),
        ("batch_index=2**63", "/ws/hook", bad(batch_index=2**63), evil, 4002),
        ("local_batch_size=2**63", "/ws/hook", bad(local_batch_size=2**63), evil, 4002),
        ("local_batch_size>B", "/ws/hook", bad(local_batch_size=9), evil, 4002),
        ("dropped=10**30", "/ws/hook", [h, metrics("evil", dropped=10**30)], evil, 4002),
        ("B=2**40", "/ws/hook", [json.dumps({**shape, "global_batch_size": 2**40})], evil, 4002),
        ("pid=2**64", "/ws/hook", [json.dumps({**shape, "pid": 2**64})], evil, 4002),
        ("ack version=2**64", "/ws/hook", [h, json.dumps({"type": "ack", "v": 1, "job": "evil", "rank": 0,
                                                          "version": 2**64, "batch_index": 0})], evil, 4002),
        ("nested JSON", "/ws/hook", [h, "[" * 100_000 + "]" * 100_000], evil, 4002),
        ("an int of 5000 digits", "/ws/hook", [h, metrics("evil").replace('"dropped":0', '"dropped":' + "9" * 5000)],
         evil, 4002),
        ("2 MiB frame", "/ws/hook", [h, "x" * (2 << 20)], evil, 1009),
        ("other job's name", "/ws/hook", [hello(job=JOB, rank=0, world_size=2, global_batch_size=16)], evil, 4403),
        ("stale process reshapes the job", "/ws/hook",
         [hello(job=JOB, rank=1, world_size=3, global_batch_size=16)], real, 4409),
        ("no token", "/ws/hook", [h], None, 4401),
        ("frame flood", "/ws/hook", [h] + [metrics("evil")] * 2000, evil, 4429),
        ("hello flood", "/ws/hook", [h] * 2000, evil, 4429),
        ("dashboard: no token", "/ws/dashboard", [], None, 4401),
        ("dashboard: bad first message", "/ws/dashboard", ["{]"], None, 4401),
        ("dashboard: hook token", "/ws/dashboard", [], evil, 4403),
        ("dashboard: big frame", "/ws/dashboard", ["y" * 100_000], ADMIN, 1009),
        ("dashboard: flood", "/ws/dashboard", ["z"] * 500, ADMIN, 4429),
    ]


def hook_token(server: Server, job: str) -> str:
    code, body = server.call("POST", "/api/v1/tokens", ADMIN, {"role": "hook", "job": job, "name": f"h-{job}"})
    assert code == 201, body
    return str(body["secret"])


def test_hostile_inputs_leave_a_running_job_whole(tmp_path: Any) -> None:
    with running_server(tmp_path, env={"REBALANCER_ADMIN_TOKEN": ADMIN, "REBALANCER_DEFAULT_MODE": "observe"}) as server:
        evil, real = hook_token(server, "evil"), hook_token(server, JOB)
        target = ["-m", "trainer_hook.demo_worker", "--server", server.url, "--job", JOB, "--token", real,
                  "--steps", str(STEPS), "--global-batch-size", "16", "--per-sample-ms", "2.0"]
        with running_torchrun(2, target) as (proc, out):
            def job() -> dict[str, Any]:
                return server.call("GET", f"/api/v1/jobs/{JOB}", ADMIN)[1]  # type: ignore[no-any-return]

            wait_until(lambda: server.call("GET", f"/api/v1/jobs/{JOB}", ADMIN)[0] == 200
                       and job()["batch_index"] is not None, "the real job's first steps", 120,
                       log=lambda: "".join(out))
            got: dict[str, int | None] = {}
            for name, path, frames, token, _ in corpus(evil, real):
                got[name] = close_code(server.ws_url + path, frames, token)
            assert proc.poll() is None, "the job ended before the corpus did: raise STEPS\n" + "".join(out)
            during = job()
            proc.wait(timeout=180)
            assert proc.returncode == 0, "".join(out)

        def stored() -> dict[int, int]:
            pts = server.call("GET", f"/api/v1/jobs/{JOB}/metrics?source=history&limit=100000", ADMIN)[1]["data"]
            per: dict[int, int] = {}
            for p in pts:
                per[p["rank"]] = per.get(p["rank"], 0) + p["n_steps"]
            return per

        wait_until(lambda: stored() == {0: STEPS, 1: STEPS}, "every stored step", 20, log=server.log)
        live = server.call("GET", f"/api/v1/jobs/{JOB}/metrics?source=live&limit=100000", ADMIN)[1]["data"]
        ranks = server.call("GET", f"/api/v1/jobs/{JOB}/ranks", ADMIN)[1]["data"]
        health = server.call("GET", "/healthz")
        log = server.log()
        alive = server.proc.poll() is None
    expected = {name: code for name, _, _, _, code in corpus(evil, real)}
    assert got == expected
    assert alive and health[0] == 200, health
    assert "Traceback" not in log, log[-4000:]
    assert (during["world_size"], during["global_batch_size"], during["placement"]["version"]) == (2, 16, 0)
    for r in (0, 1):  # live: every batch of every rank, once
        assert sorted(p["batch_index"] for p in live if p["rank"] == r) == list(range(STEPS)), r
    assert {r["rank"]: r["n_steps"] for r in ranks} == {0: STEPS, 1: STEPS}
    assert all(r["dropped"] == 0 for r in ranks)

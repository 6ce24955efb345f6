"""Numbers out of range are refused at the edge of a real backend (issue 15, defects 1 and 6).

One frame with ``t=1e308`` or an index beyond int64 used to be accepted by /ws/hook and
then broke the next SQL save for every job; integers beyond int64 gave 1011 on the
websocket and 500 on REST. Each is now a 4002 close (or a 422) with one sentence, and a
concurrent job's stored history is whole.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.sync.client import connect

from rebalancer_wire.protocol import Ack, Hello, encode
from tests.backend._app import closed, hello, metrics
from tests.helpers.server import Server, running_server
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.multiproc

BIG = 2**63


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("ranges")) as s:
        yield s


def step(**over: Any) -> dict[str, Any]:
    rec = {"batch_index": 0, "local_batch_size": 4, "placement_version": 0, "data_wait_ms": 0.1,
           "compute_ms": 1.0, "sync_wait_ms": 0.1, "optimizer_ms": 0.1, "step_ms": 1.5, "t": time.time()}
    return {**rec, **over}


def metrics_frame(job: str, rank: int = 0, *, steps: list[dict[str, Any]] | None = None, **over: Any) -> str:
    return json.dumps({"type": "metrics", "v": 1, "job": job, "rank": rank, "steps": steps or [],
                       "device": [], "dropped": 0, **over})


def refused(server: Server, frames: list[str]) -> tuple[int, str, dict[str, Any]]:
    """Send ``frames`` on a new /ws/hook connection; return (close code, reason, error frame)."""
    with connect(server.ws_url + "/ws/hook") as ws:
        for f in frames:
            ws.send(f)
        code, reason, replies = closed(ws)
    errors = [r for r in replies if r["type"] == "error"]
    assert len(errors) == 1, replies
    return code, reason, errors[0]


HOSTILE_METRICS = {
    "t=1e308": ([step(t=1e308)], "'t' must be a number between 0 and 10000000000, got 1e+308."),
    "batch_index=2**63": ([step(batch_index=BIG)],
                          f"'batch_index' must be between 0 and 2147483647, got {BIG}."),
    "local_batch_size=2**63": ([step(local_batch_size=BIG)],
                               f"'local_batch_size' must be between 0 and 16777216, got {BIG}."),
    "local_batch_size>B": ([step(local_batch_size=33)],
                           "'steps[0].local_batch_size' is 33 but the job's global batch is 32."),
    # stamped when the test runs (collection may be many minutes earlier)
    "t-a-year-ago": (lambda: [step(t=time.time() - 365 * 86400)], r"'steps\[0\]\.t' is -315360[0-9]{2} s from the backend's "
                     r"clock; it must be within 7 days before and 1 hour after it \(check the node's clock\)\.$"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_METRICS))
def test_out_of_range_metrics_close_4002_and_spare_the_other_jobs_history(server: Server, case: str) -> None:
    victim = f"victim-{case}"
    steps, message = HOSTILE_METRICS[case]
    if callable(steps):
        steps = steps()
    with connect(server.ws_url + "/ws/hook") as good:
        good.send(hello(job=victim, rank=0, world_size=1, global_batch_size=32))
        assert json.loads(good.recv(timeout=10))["type"] == "placement"
        good.send(metrics(job=victim, rank=0, first=0, n=10))
        code, reason, err = refused(server, [
            hello(job=f"evil-{case}", rank=0, world_size=1, global_batch_size=32),
            metrics_frame(f"evil-{case}", steps=steps),
        ])
        good.send(metrics(job=victim, rank=0, first=10, n=10))

        def stored() -> bool:
            pts = server.get(f"/api/v1/jobs/{victim}/metrics?source=history")["data"]  # type: ignore[index]
            return sum(p["n_steps"] for p in pts) == 20

        wait_until(stored, f"{victim}'s 20 steps in the stored history", 20, log=server.log)
    assert code == 4002, (code, reason)
    assert err["code"] == "malformed"
    assert err["message"].startswith(message) or re.match(message, err["message"]), err
    assert "OverflowError" not in server.log() and "Traceback" not in server.log(), server.log()[-3000:]


def test_dropped_beyond_int32_closes_4002(server: Server) -> None:
    code, _, err = refused(server, [hello(job="drops", rank=0, world_size=1, global_batch_size=8),
                                    metrics_frame("drops", dropped=10**30)])
    assert code == 4002
    assert err["message"] == f"'dropped' must be between 0 and 2147483647, got {10**30}."


@pytest.mark.parametrize(("over", "message"), [
    ({"global_batch_size": 2**40}, "'global_batch_size' must be between 1 and 16777216, got 1099511627776."),
    ({"global_batch_size": 1, "world_size": 2}, "'global_batch_size' (1) must be at least 'world_size' (2): "
                                                "every rank needs a sample."),
    ({"pid": 2**64}, "'pid' must be between 0 and 2147483647, got 18446744073709551616."),
    ({"batch_index": BIG}, f"'batch_index' must be between 0 and 2147483647, got {BIG}."),
    ({"mem_total_bytes": BIG}, f"'mem_total_bytes' must be between 0 and 9007199254740992, got {BIG}."),
    ({"restart_count": -1}, "'restart_count' must be between 0 and 2147483647, got -1."),
], ids=["B=2**40", "B<world", "pid", "batch_index", "mem", "restart_count"])
def test_out_of_range_hello_closes_4002(server: Server, over: dict[str, Any], message: str) -> None:
    body = json.loads(hello(job="shape", rank=0, world_size=1, global_batch_size=8))
    code, _, err = refused(server, [json.dumps({**body, **over})])
    assert (code, err["message"]) == (4002, message)


def test_ack_version_beyond_int64_closes_4002(server: Server) -> None:
    ack = json.loads(encode(Ack(job="acks", rank=0, version=0, batch_index=0)))
    code, _, err = refused(server, [hello(job="acks", rank=0, world_size=1, global_batch_size=8),
                                    json.dumps({**ack, "version": 2**64})])
    assert (code, err["message"]) == (4002, "'version' must be between 0 and 2147483647, got 18446744073709551616.")


@pytest.mark.parametrize("path", [
    f"/api/v1/jobs/x/proposals/{2**64}",
    f"/api/v1/jobs/x/metrics?rank={2**64}",
    f"/api/v1/jobs/x/metrics?batch_from={2**63}",
    f"/api/v1/jobs/x/metrics?batch_to={2**63}",
    f"/api/v1/jobs/x/forecast?total_steps={2**63}",
])
def test_rest_integers_beyond_their_range_get_422(server: Server, path: str) -> None:
    code, body = server.call("GET", path)
    assert code == 422, (code, body)
    assert isinstance(body["detail"], (str, list)) and body["detail"]


@pytest.mark.parametrize(("method", "path"), [("POST", f"/api/v1/jobs/x/proposals/{2**64}/approve"),
                                             ("POST", f"/api/v1/jobs/x/proposals/{2**64}/reject"),
                                             ("DELETE", f"/api/v1/tokens/{2**64}")])
def test_rest_mutations_with_ids_beyond_int64_get_422(server: Server, method: str, path: str) -> None:
    code, body = server.call(method, path, body={} if method == "POST" else None)
    assert code == 422, (code, body)


def test_a_valid_hello_still_works(server: Server) -> None:
    h = Hello(job="fine", rank=0, world_size=2, global_batch_size=2**24, pid=4_194_304, restart_count=3)
    with connect(server.ws_url + "/ws/hook") as ws:
        ws.send(encode(h))
        reply = json.loads(ws.recv(timeout=10))
    assert reply["type"] == "placement" and reply["shares"] == [2**23, 2**23]


# --- NUL characters: PostgreSQL text cannot hold them -----------------------------------

NUL_SENTENCE = "Text may not contain the NUL character (\\u0000); remove it and try again."


def test_nul_in_a_hook_name_closes_4002(server: Server) -> None:
    """A hello whose job (or host) holds a NUL used to reach SQL: 1011 on PostgreSQL."""
    code, _, err = refused(server, [hello(job="n\x00ul", rank=0, world_size=1, global_batch_size=8)])
    assert code == 4002 and err["message"] == "'job' must not contain the NUL character (\\u0000).", err
    frame = hello(job="nul-host", rank=0, world_size=1, global_batch_size=8)
    code, _, err = refused(server, [frame.replace('"host":"h"', '"host":"h\\u0000"')])
    assert code == 4002 and err["message"] == "'host' must not contain the NUL character (\\u0000).", err
    assert "n\x00ul" not in [j["job"] for j in server.get("/api/v1/jobs")["data"]]  # type: ignore[index]


@pytest.mark.postgres
def test_nul_in_rest_text_is_422_on_postgresql(tmp_path: Any) -> None:
    """PostgreSQL refuses NUL in text: any REST string with one (path, query, body) gave 500."""
    from tests.helpers.postgres import pg_schema

    with pg_schema() as url, running_server(tmp_path, db_url=url) as pg:
        with connect(pg.ws_url + "/ws/hook") as ws:
            ws.send(hello(job="nul-rest", rank=0, world_size=1, global_batch_size=8))
            assert json.loads(ws.recv(timeout=10))["type"] == "placement"
            wait_until(lambda: pg.call("GET", "/api/v1/jobs/nul-rest")[0] == 200, "the job", 10)
            for method, path, body in (
                ("GET", "/api/v1/jobs/a%00b", None),
                ("GET", "/api/v1/jobs/a%00b/placements", None),
                ("GET", "/api/v1/audit?job=a%00b", None),
                ("PUT", "/api/v1/jobs/nul-rest/mode", {"mode": "observe", "reason": "a\x00b"}),
                ("POST", "/api/v1/tokens", {"role": "viewer", "name": "a\x00b"}),
            ):
                assert pg.call(method, path, body=body) == (422, {"detail": NUL_SENTENCE}), (method, path)
            assert pg.call("GET", "/api/v1/jobs/nul-rest")[1]["mode"] != "observe"  # nothing changed
            assert pg.call("GET", "/healthz")[1]["status"] == "ok"
        assert "Traceback" not in pg.log(), pg.log()[-3000:]

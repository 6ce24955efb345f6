"""End to end: a real backend process (uvicorn) and a real torchrun/gloo job of
``trainer_hook.demo_worker`` with one slow rank.

approve mode: the slow rank yields a proposal; a viewer cannot approve it; an operator can;
every rank switches at one batch index; the step time drops; a backend restart mid-job
loses nothing and the ranks resynchronise to the placement in force.
auto mode: the same with no operator.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from backend.auth.tokens import create_token
from backend.storage.base import make_engine, make_sessionmaker
from tests.helpers.ports import free_port
from tests.helpers.server import Server, running_server
from tests.helpers.torchrun import running_torchrun
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

ADMIN = "e2e-admin-secret-0123456789"
B = 48
SPEEDS = "1,0.25"  # rank 1 four times slower
# Small windows so the whole story fits in tens of steps.
ENV = {
    "REBALANCER_ADMIN_TOKEN": ADMIN,
    "REBALANCER_MIN_STEPS": "6",
    "REBALANCER_COOLDOWN_STEPS": "10",
    "REBALANCER_EFFECT_WINDOW_STEPS": "8",
    "REBALANCER_PERSIST_INTERVAL_S": "0.5",
}


def call(server: Server, method: str, path: str, token: str, body: Any = None) -> tuple[int, Any]:
    return server.call(method, path, token, body)


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 120.0, proc: subprocess.Popen | None = None,
             log: list[str] | None = None) -> Any:
    def check() -> Any:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}) while waiting for {what}:\n" + "".join(log or []))
        return fn()

    return wait_until(check, what, timeout, interval=0.25, log=lambda: "".join((log or [])[-50:]))


@contextmanager
def job(url: str, name: str) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    with running_torchrun(2, ["-m", "trainer_hook.demo_worker", "--server", url, "--job", name,
                              "--token", ADMIN, "--steps", "0", "--global-batch-size", str(B),
                              "--speeds", SPEEDS, "--per-sample-ms", "1.0", "--fixed-ms", "1.0"]) as running:
        yield running


def tokens(db_url: str) -> dict[str, str]:
    engine = make_engine(db_url)
    from backend.parts import init_db

    init_db(engine)
    with make_sessionmaker(engine)() as s:
        _, op = create_token(s, role="operator", name="e2e-operator")
        _, viewer = create_token(s, role="viewer", name="e2e-viewer")
        s.commit()
    engine.dispose()
    return {"operator": op, "viewer": viewer}


def assert_controller_clean(server: Server) -> None:
    """None of the controller's failure messages appear in the server's log."""
    log = server.log()
    for text in ("policy run for job", "controller tick failed", "static placement for job",
                 "sending placement", "the policy failed"):
        assert text not in log, log


def mean_step_ms(server: Server, name: str, lo: int, hi: int) -> float:
    """Mean over batch indices lo..hi of rank 0's step time, from the metrics API."""
    _, m = call(server, "GET", f"/api/v1/jobs/{name}/metrics?rank=0&batch_from={lo}&batch_to={hi}&source=live", ADMIN)
    pts = [p["step_ms"] for p in m["data"]]
    assert len(pts) >= (hi - lo + 1) // 2, m
    return sum(pts) / len(pts)


def applied(server: Server, name: str, version: int) -> dict[str, Any] | None:
    _, pl = call(server, "GET", f"/api/v1/jobs/{name}/placements", ADMIN)
    row = next((p for p in pl["data"] if p["version"] == version), None)
    return row if row and row["applied_at"] is not None else None


def check_switch_and_speedup(server: Server, name: str, version: int, proc, out) -> dict[str, Any]:
    row = wait_for(f"every rank to apply version {version}", lambda: applied(server, name, version), proc=proc, log=out)
    acks = row["acks"]
    assert set(acks) == {"0", "1"}
    assert len(set(acks.values())) == 1, f"ranks switched at different batch indices: {acks}"
    e = row["effective_batch_index"]
    assert e == next(iter(acks.values()))
    # Step time before vs after, from the raw per-step metrics of the same run.
    wait_for("steps after the switch", lambda: call(server, "GET", f"/api/v1/jobs/{name}", ADMIN)[1].get("batch_index", 0) >= e + 14,
             proc=proc, log=out)
    before = mean_step_ms(server, name, max(0, e - 8), e - 1)
    after = mean_step_ms(server, name, e + 3, e + 12)
    print(f"[{name}] version {version} at batch {e}: step {before:.1f} ms -> {after:.1f} ms "
          f"(ratio {after / before:.2f})")
    assert after / before < 0.8, (before, after)
    # The controller's own record of the effect agrees in direction.
    row = wait_for("the measured effect", lambda: (r := applied(server, name, version)) and r["effect"]["step_ms_after"] and r,
                   proc=proc, log=out)
    assert row["effect"]["step_ms_after"] < row["effect"]["step_ms_before"]
    assert row["effect"]["measured_gain"] > 0.2
    return row


def test_approve_mode_with_restart(tmp_path: Path):
    db_url = f"sqlite:///{tmp_path / 'rebalancer.db'}"
    tok = tokens(db_url)
    port = free_port()
    name = "e2e-approve"
    with job(f"http://127.0.0.1:{port}", name) as (proc, out):
        with running_server(tmp_path, db_url=db_url, port=port, env=ENV) as server:
            prop, version, snapshot = approve_flow(server, name, tok, proc, out)
            assert_controller_clean(server)
        # The first server is gone; the job trains on. A new one on the same port and database:
        with running_server(tmp_path, db_url=db_url, port=port, env=ENV) as server:
            check_restart(server, name, prop, version, snapshot, proc, out)


def approve_flow(server, name, tok, proc, out):
    base = f"/api/v1/jobs/{name}"
    prop = wait_for("a proposal for the slow rank", lambda: (
            (r := call(server, "GET", f"{base}/proposals?status=proposed", tok["viewer"]))[0] == 200
            and r[1]["count"] and r[1]["data"][0]), proc=proc, log=out)
    assert prop["source"] == "policy" and prop["shares"][1] < prop["shares"][0]
    assert sum(prop["shares"]) == B
    status, body = call(server, "POST", f"{base}/proposals/{prop['id']}/approve", tok["viewer"], {})
    assert (status, body) == (403, {"detail": "This action needs the operator role."})
    status, body = call(server, "POST", f"{base}/proposals/{prop['id']}/approve", tok["operator"],
                        {"reason": "rank 1 is the straggler"})
    if status == 409:  # a newer proposal superseded this one between the GET and the POST
        prop = call(server, "GET", f"{base}/proposals?status=proposed", tok["viewer"])[1]["data"][0]
        status, body = call(server, "POST", f"{base}/proposals/{prop['id']}/approve", tok["operator"],
                            {"reason": "rank 1 is the straggler"})
    assert status == 200, body
    version = body["placement_version"]
    row = check_switch_and_speedup(server, name, version, proc, out)
    assert row["shares"] == prop["shares"]  # exactly the reviewed shares
    snapshot = {k: call(server, "GET", f"{base}/{k}", ADMIN)[1]["data"] for k in ("proposals", "placements", "audit")}
    return prop, version, snapshot


def check_restart(server, name, prop, version, snapshot, proc, out):
    base = f"/api/v1/jobs/{name}"
    again = {k: call(server, "GET", f"{base}/{k}", ADMIN)[1]["data"] for k in ("proposals", "placements", "audit")}
    for kind in ("proposals", "placements", "audit"):
        ids = {(r.get("id"), r.get("version")) for r in again[kind]}
        assert {(r.get("id"), r.get("version")) for r in snapshot[kind]} <= ids, kind
    approved = next(p for p in again["proposals"] if p["id"] == prop["id"])
    assert approved["status"] == "applied" and approved["decided_by"] == "e2e-operator"
    assert any(a["action"] == "proposal.approve" and a["reason"] for a in again["audit"])
    # Hooks reconnect (hello) and train on under the placement in force.
    wait_for("every rank to reconnect", lambda: call(server, "GET", base, ADMIN)[1].get("connected_ranks") == 2,
             proc=proc, log=out)
    job_now = call(server, "GET", base, ADMIN)[1]
    assert job_now["placement"] == {"version": version, "shares": prop["shares"]}
    k0 = job_now["batch_index"] or 0
    wait_for("steps under the placement in force", lambda: (
        pts := call(server, "GET", f"{base}/metrics?batch_from={k0 + 1}&source=live", ADMIN)[1]["data"])
        and {p["rank"] for p in pts} == {0, 1}, proc=proc, log=out)
    pts = call(server, "GET", f"{base}/metrics?batch_from={k0 + 1}&source=live", ADMIN)[1]["data"]
    assert {p["placement_version"] for p in pts} == {version}
    # The slow rank trains its reviewed share (an epoch's last, partial batch may be smaller).
    sizes = [p["local_batch_size"] for p in pts if p["rank"] == 1]
    assert max(set(sizes), key=sizes.count) == prop["shares"][1], sizes


def test_auto_mode_applies_without_an_operator(tmp_path: Path):
    name = "e2e-auto"
    with running_server(tmp_path, env={**ENV, "REBALANCER_DEFAULT_MODE": "auto"}) as server, \
            job(server.url, name) as (proc, out):
        base = f"/api/v1/jobs/{name}"
        version = wait_for("an auto-applied placement", lambda: next(
            (p["version"] for p in call(server, "GET", f"{base}/placements", ADMIN)[1].get("data", [])
             if p["source"] == "auto"), None), proc=proc, log=out)
        row = check_switch_and_speedup(server, name, version, proc, out)
        # The auto-mode guardrail: no rank moved by more than a quarter of the batch.
        assert max(abs(a - b) for a, b in zip(row["shares"], row["previous_shares"], strict=True)) <= B // 4
        audit = call(server, "GET", f"{base}/audit", ADMIN)[1]["data"]
        auto = [a for a in audit if a["action"] == "proposal.auto_apply"]
        assert auto and auto[-1]["actor"] == "auto"
        assert_controller_clean(server)

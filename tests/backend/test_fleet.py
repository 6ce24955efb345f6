"""The fleet summary (backend.live.fleet): pure rows and totals, the hub's per-tick figures
(waste, efficiency, pending, bound, one encode for every overview client), and the REST
route and /metrics totals in the real app, all from the one function."""

from __future__ import annotations

import asyncio

import pytest

from backend.live.fleet import FleetJob, balance_gap_ms, fleet_summary
from backend.policy.solver import predicted_step_ms, solve
from tests.backend._app import hello, metrics
from tests.backend.test_hub import (
    GBS,
    FakeSocket,
    _feed,
    _hub,
    _register,
    _run_async,
    _services,
    _settle,
)
from tests.conftest import ADMIN
from tests.helpers.waiting import wait_until

# --- the pure function ----------------------------------------------------------------


def _job(name: str, **kw) -> FleetJob:
    return FleetJob(job=name, **{"status": "balanced", "world_size": 2, "connected_ranks": 2, **kw})


def test_rows_are_sorted_by_name_and_totals_add_up():
    got = fleet_summary([
        _job("b", status="idle", connected_ranks=0, wasted_ms=3.6e6, saved_s=10.0, saved_cost=0.5),
        _job("a", world_size=4, connected_ranks=4, wasted_ms=7.2e6, saved_s=-2.0, pending_proposal_id=7,
             devices=(("H100", 3), ("A100", 1)), bound="input"),
        _job("c", status="imbalanced", saved_s=None, saved_cost=None),
    ])
    assert [r["job"] for r in got["data"]] == ["a", "b", "c"] and got["count"] == 3
    a = got["data"][0]
    assert a["devices"] == [{"kind": "H100", "count": 3}, {"kind": "A100", "count": 1}]
    assert a["wasted_gpu_hours"] == 2.0 and a["bound"] == "input"
    assert a["pending_proposals"] == 1 and a["pending_proposal_id"] == 7
    assert got["data"][1]["pending_proposals"] == 0 and got["data"][2]["bound"] is None
    assert a["goodput"] is None
    assert got["totals"] == {
        "jobs": 3, "ranks": 8, "connected_ranks": 6, "running": 2,
        "by_status": {"balanced": 1, "idle": 1, "imbalanced": 1},
        "wasted_gpu_hours": 3.0, "saved_s": 8.0, "saved_cost": 0.5, "pending_proposals": 1,
        "efficiency": None,
    }


def test_empty_fleet():
    assert fleet_summary([]) == {"data": [], "count": 0, "totals": {
        "jobs": 0, "ranks": 0, "connected_ranks": 0, "running": 0, "by_status": {},
        "wasted_gpu_hours": 0.0, "saved_s": 0.0, "saved_cost": None, "pending_proposals": 0,
        "efficiency": None}}


def test_efficiency_is_balanced_over_achieved_and_na_without_a_fit():
    got = fleet_summary([_job("fit", step_ms=50.0, balance_gap_ms=10.0, world_size=2),
                         _job("nofit", step_ms=50.0),
                         _job("nostep", balance_gap_ms=10.0),
                         _job("big", step_ms=40.0, balance_gap_ms=0.0, world_size=6)])
    rows = {r["job"]: r for r in got["data"]}
    assert rows["fit"]["balanced_step_ms"] == 40.0 and rows["fit"]["efficiency"] == 0.8
    assert rows["big"]["efficiency"] == 1.0
    assert rows["nofit"]["efficiency"] is None and rows["nostep"]["efficiency"] is None
    assert got["totals"]["efficiency"] == pytest.approx((0.8 * 2 + 1.0 * 6) / 8, abs=1e-4)


def test_a_gap_larger_than_the_step_never_makes_a_negative_step():
    (row,) = fleet_summary([_job("x", step_ms=5.0, balance_gap_ms=9.0)])["data"]
    assert row["balanced_step_ms"] == 0.0 and row["efficiency"] == 0.0


def test_bound_reads_the_verdict_and_anything_else_as_unknown():
    rows = fleet_summary([_job("a", bound="compute"), _job("b", bound={"verdict": "input"}),
                          _job("c", bound={"bound": "communication", "share": 0.4}),
                          _job("d", bound=""), _job("e", bound=3), _job("f", bound={"x": 1})])["data"]
    assert [r["bound"] for r in rows] == ["compute", "input", "communication", None, None, None]


def test_balance_gap_is_the_oracle_split_against_the_placement():
    a, c = (1.0, 1.0, 1.0), (1.0, 1.0, 4.0)
    gap = balance_gap_ms(a, c, (8, 8, 8), 24)
    best = predicted_step_ms(a, c, solve(a, c, 24))
    assert gap == pytest.approx(33.0 - best) and gap > 0
    assert balance_gap_ms(a, c, solve(a, c, 24), 24) == 0.0


@pytest.mark.parametrize("a, c, shares, gbs", [
    ((1.0, 1.0), (1.0, 1.0, 4.0), (8, 8, 8), 24),  # fit of another world size
    ((1.0, 1.0, 1.0), (1.0, 1.0, 4.0), (8, 8), 24),  # placement of another world size
    ((1.0, 1.0, 1.0), (1.0, -1.0, 4.0), (8, 8, 8), 24),  # a bad fit
    ((1.0, 1.0, 1.0), (1.0, float("nan"), 4.0), (8, 8, 8), 24),
    ((1.0, 1.0, 1.0), (1.0, 1.0, 4.0), (8, 8, 7), 24),  # shares that do not sum to B
    ((), (), (), 0),
])
def test_balance_gap_is_na_where_fit_and_placement_do_not_match(a, c, shares, gbs):
    assert balance_gap_ms(a, c, shares, gbs) is None


# --- the hub: figures per job, one summary per tick --------------------------------------


def test_hub_counts_waiting_for_the_slowest_rank_as_waste():
    svc = _services()
    _register(svc.live)
    hub = _hub(svc, clock=lambda: 0.0)
    for b in range(4):
        _feed(svc.live, b)  # computes 8, 8, 32 ms: 24 + 24 ms wasted a batch
    hub.notify("j")
    hub.tick()
    (row,) = hub.fleet()["data"]
    assert row["wasted_gpu_hours"] == pytest.approx(4 * 48.0 / 3.6e6, abs=1e-9)
    assert row["devices"] == [{"kind": "H100", "count": 2}, {"kind": "A100", "count": 1}]
    assert row["efficiency"] is None  # the policy has not fitted the job
    assert row["world_size"] == 3 and row["status"] == "warming_up"


def test_hub_efficiency_uses_the_policys_fit_and_solves_once_per_fit_and_placement(monkeypatch):
    import backend.dashboard.fold as fold_mod

    svc = _services()
    _register(svc.live)
    svc.fit = ((0.0, 0.0, 0.0), (1.0, 1.0, 4.0))
    svc.control = {"status": "proposal_pending", "status_detail": "", "mode": "approve",
                   "placement": {"version": 0, "shares": [8, 8, 8]},
                   "pending_proposal": {"id": 3, "status": "proposed"}}
    calls = []
    real = fold_mod.balance_gap_ms
    monkeypatch.setattr(fold_mod, "balance_gap_ms", lambda *a: calls.append(a) or real(*a))
    now = [0.0]
    hub = _hub(svc, clock=lambda: now[0])
    for b in range(3):
        _feed(svc.live, b)
        hub.notify("j")
        hub.tick()
    assert len(calls) == 1
    (row,) = hub.fleet()["data"]
    # slowest now 32 ms; the oracle (16, 16, 4... in samples) gives 16 ms: 16 ms less a step
    best = predicted_step_ms(*svc.fit, solve(*svc.fit, GBS))
    assert row["balanced_step_ms"] == pytest.approx(33.0 - (32.0 - best), abs=1e-3)
    assert row["efficiency"] == pytest.approx(row["balanced_step_ms"] / 33.0, abs=1e-4)
    assert row["pending_proposals"] == 1 and row["pending_proposal_id"] == 3
    assert hub.fleet()["totals"]["pending_proposals"] == 1
    svc.fit = ((0.0, 0.0, 0.0), (1.0, 1.0, 2.0))  # a new fit: solved again
    _feed(svc.live, 3)
    hub.notify("j")
    hub.tick()
    assert len(calls) == 2


def test_hub_passes_the_summarys_bound_through(monkeypatch):
    svc = _services()
    _register(svc.live)
    hub = _hub(svc, clock=lambda: 0.0)
    real = hub._summary
    monkeypatch.setattr(hub, "_summary", lambda feed, view: {**real(feed, view), "bound": "communication"})
    _feed(svc.live, 0)
    hub.notify("j")
    hub.tick()
    assert hub.fleet()["data"][0]["bound"] == "communication"


@_run_async
async def test_one_fleet_summary_per_tick_and_one_encode_for_every_overview_client():
    svc = _services()
    for name in ("a", "b"):
        _register(svc.live, name)
    hub = _hub(svc, clock=lambda: 0.0)
    built = []
    import backend.dashboard.hub as hub_mod
    real = hub_mod.fleet_summary
    hub_mod.fleet_summary = lambda jobs: built.append(1) or real(jobs)
    try:
        socks = [FakeSocket() for _ in range(5)]
        tasks = [asyncio.create_task(hub.attach(s.send, None)) for s in socks]
        await _settle()
        n0 = len(built)
        for b in range(3):
            _feed(svc.live, b, job="a")
            hub.notify("a")
            hub.tick()
            await _settle()
        for t in tasks:
            t.cancel()
    finally:
        hub_mod.fleet_summary = real
    assert n0 == 1 and len(built) == 1 + 3  # once per tick, not per client
    last = socks[0].frames[-1]
    assert all(s.frames[-1] == last for s in socks)
    assert [r["job"] for r in last["fleet"]["data"]] == ["a", "b"]
    assert last["fleet"]["totals"]["jobs"] == 2 and [j["job"] for j in last["jobs"]] == ["a", "b"]


def test_a_read_keeps_every_job_fresh_for_a_minute():
    svc = _services()
    _register(svc.live)
    now = [0.0]
    hub = _hub(svc, clock=lambda: now[0])
    _feed(svc.live, 0)
    hub.notify("j")
    hub.tick()
    svc.control = {"status": "idle", "status_detail": "no metrics from the job recently",
                   "placement": {"version": 0, "shares": [8, 8, 8]}}
    now[0] = 2.0
    hub.tick()  # nobody read the fleet: the idle job is not refreshed
    assert hub.fleet()["data"][0]["status"] == "warming_up"
    now[0] = 4.0
    hub.tick()  # read just now: refreshed once a second
    assert hub.fleet()["data"][0]["status"] == "idle"


# --- the real app: REST and /metrics read the same summary -----------------------------


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _scraped(client) -> dict[str, float]:
    text = client.get("/metrics", headers=_bearer(ADMIN)).text
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                     if line.startswith("rebalancer_fleet_"))}


def test_rest_and_metrics_show_the_same_totals(app_client):
    client = app_client
    assert client.get("/api/v1/fleet").json() == {"detail": "Missing or invalid bearer token."}
    with client.websocket_connect("/ws/hook", headers=_bearer(ADMIN)) as h0, \
            client.websocket_connect("/ws/hook", headers=_bearer(ADMIN)) as h1:
        for rank, ws in enumerate((h0, h1)):
            ws.send_text(hello(rank=rank))
            ws.receive_text()
        h0.send_text(metrics(rank=0, first=0, n=5, compute_ms=10.0))
        h1.send_text(metrics(rank=1, first=0, n=5, compute_ms=30.0, step_ms=40.0))

        def fleet() -> dict:
            r = client.get("/api/v1/fleet", headers=_bearer(ADMIN))
            assert r.status_code == 200, r.text
            return r.json()

        got = wait_until(lambda: (f := fleet())["data"] and f["data"][0]["wasted_gpu_hours"] > 0 and f,
                         "the job's closed batches in the fleet", 20)
        assert got["count"] == 1 and got["data"][0]["job"] == "j"
        assert got["data"][0]["wasted_gpu_hours"] == pytest.approx(5 * 20.0 / 3.6e6, abs=1e-9)
        t = got["totals"]
        assert t["jobs"] == 1 and t["ranks"] == 2 and t["running"] == 1
        lines = _scraped(client)
        assert lines["rebalancer_fleet_jobs"] == 1.0
        assert lines["rebalancer_fleet_ranks"] == 2.0
        assert lines["rebalancer_fleet_running_jobs"] == 1.0
        assert lines["rebalancer_fleet_wasted_gpu_seconds"] == pytest.approx(5 * 20.0 / 1000, abs=1e-4)
        # The policy may propose between two reads: wait until both read the same count.
        wait_until(lambda: _scraped(client)["rebalancer_fleet_pending_proposals"]
                   == fleet()["totals"]["pending_proposals"], "the same pending count", 20)
        assert lines["rebalancer_fleet_saved_seconds"] == t["saved_s"]


def test_goodput_travels_with_the_row():
    from backend.live.fleet import fleet_job_dict, fleet_job_from_dict

    j = _job("g", goodput=0.8125)
    assert fleet_summary([j])["data"][0]["goodput"] == 0.8125
    assert fleet_job_from_dict(fleet_job_dict(j)).goodput == 0.8125  # another replica's fleet
    old = fleet_job_dict(j)
    del old["goodput"]  # a replica from before goodput
    assert fleet_job_from_dict(old).goodput is None

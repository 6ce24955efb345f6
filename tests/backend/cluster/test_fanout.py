"""Two real ``rebalancer serve`` replicas on one PostgreSQL schema of their own and the real
Redis under a key prefix of their own, one shared pair for the module. Replica A owns a job
whose fake ranks (real /ws/hook websockets, ``tests.helpers.fake_fleet``) stream to it;
replica B shows that job live (its dashboard websocket, its REST job view) and forwards the
operator actions sent to it to A, which applies and audits each once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.cluster import (
    REDIS_URL,
    Replicas,
    redis_or_skip,
    redis_under_prefix,
    running_replicas,
)

redis = redis_or_skip()

from websockets.sync.client import connect  # noqa: E402

from tests.helpers.fake_fleet import FakeFleet, FakeJob  # noqa: E402
from tests.helpers.ports import free_port  # noqa: E402
from tests.helpers.server import Server  # noqa: E402
from tests.helpers.waiting import wait_until  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

ADMIN = "fanout-admin-secret-0123456789abc"
JOB = "fanned"
BASE = f"/api/v1/jobs/{JOB}"


class Pair:
    def __init__(self, replicas: Replicas, fleet: FakeFleet):
        self.a, self.b, self.fleet, self.prefix, self.redis = replicas.a, replicas.b, fleet, replicas.prefix, replicas.redis
        self.log = replicas.log

    def get(self, server: Server, path: str) -> Any:
        status, body = server.call("GET", path, ADMIN)
        assert status == 200, (path, status, body)
        return body

    def counter(self, server: Server, name: str, outcome: str) -> float:
        import urllib.request

        req = urllib.request.Request(f"{server.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
        [line] = [x for x in text.splitlines() if x.startswith(f'{name}{{outcome="{outcome}"}} ')]
        return float(line.split()[-1])


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    env = {"REBALANCER_ADMIN_TOKEN": ADMIN, "REBALANCER_FANOUT_INTERVAL_S": "0.2", "REBALANCER_DEFAULT_MODE": "approve"}
    with running_replicas(tmp_path_factory.mktemp("fanout"), env, ttl_s=3) as replicas:
        fleet = FakeFleet(replicas.a.ws_url, ADMIN)
        try:
            fleet.add(FakeJob(JOB, ["cpu", "cpu"], [1.0, 2.0], 32), 20)
            assert replicas.lease(JOB) is not None
            yield Pair(replicas, fleet)
        finally:
            fleet.close()


def _frames(ws: Any, until: Any, what: str, limit: int = 200) -> dict[str, Any]:
    """Read the job's frames, each merged into one view, until ``until(view)`` holds."""
    view: dict[str, Any] = {"b": [], "control": {}, "summary": None}
    for _ in range(limit):
        frame = json.loads(ws.recv(timeout=20))
        assert frame["type"] == "job" and frame["job"] == JOB, frame
        view["b"] += frame["series"]["b"]
        view["summary"] = frame["summary"] or view["summary"]
        view["control"] = frame.get("control", view["control"])
        if frame.get("ranks"):
            view["ranks"] = frame["ranks"]
        if until(view):
            return view
    raise AssertionError(f"no frame showed {what}: {view}")


def test_a_dashboard_on_the_replica_without_the_job_is_live(pair: Pair) -> None:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    with connect(f"{pair.b.ws_url}/ws/dashboard?job={JOB}", additional_headers=headers) as ws:
        view = _frames(ws, lambda v: v["b"] and max(v["b"]) == 19 and v.get("ranks"),
                       "the 20 batches the ranks sent to replica A")
        assert view["summary"]["world_size"] == 2 and view["ranks"]["rank"] == [0, 1]
        assert view["control"]["mode"] == "approve"
        pair.fleet.steps(JOB, 15)  # new batches at A reach B's dashboard, as deltas
        view = _frames(ws, lambda v: v["b"] and max(v["b"]) == 34, "the 15 batches sent later")
        assert sorted(set(view["b"])) == view["b"], "every batch once, in order"
        # An operator action at A shows on B's dashboard (the control state travels too).
        status, body = pair.a.call("PUT", f"{BASE}/mode", ADMIN, {"mode": "observe", "reason": "fan-out"})
        assert status == 200, body
        _frames(ws, lambda v: v["control"].get("mode") == "observe", "the mode set at replica A")
    # B's REST view of the job is A's live one, not what B last loaded.
    assert pair.get(pair.b, BASE)["batch_index"] == pair.get(pair.a, BASE)["batch_index"] == 34
    assert pair.get(pair.b, BASE)["connected_ranks"] == 2
    assert pair.get(pair.b, f"{BASE}/ranks")["count"] == 2
    assert pair.get(pair.b, f"{BASE}/summary")["batch_index"] == 34
    assert pair.counter(pair.a, "rebalancer_fanout_snapshots_total", "stored") >= 1
    assert pair.counter(pair.b, "rebalancer_fanout_snapshots_total", "applied") >= 1
    assert pair.counter(pair.b, "rebalancer_fanout_snapshots_total", "refused") == 0
    # The report is built from live state: B's is A's, with the page's own CSP.
    import urllib.request

    def html(server: Server) -> tuple[str, str]:
        req = urllib.request.Request(f"{server.url}{BASE}/report?format=html",
                                     headers={"Authorization": f"Bearer {ADMIN}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.headers["Content-Security-Policy"], r.headers.get("X-Rebalancer-Forwarded-To")

    (csp_b, via), (csp_a, _) = html(pair.b), html(pair.a)
    assert csp_b == csp_a and "sha256-" in csp_b
    assert via == pair.redis.get(f"{pair.prefix}:lease:{JOB}").decode()


def test_actions_at_the_replica_without_the_job_are_applied_once_by_its_owner(pair: Pair) -> None:
    status, body = pair.b.call("PUT", f"{BASE}/mode", ADMIN, {"mode": "approve", "reason": "mode at B"})
    assert status == 200 and body["mode"] == "approve", body
    status, proposal = pair.b.call("POST", f"{BASE}/proposals", ADMIN, {"shares": [20, 12], "reason": "via B"})
    assert status == 201, proposal
    status, approved = pair.b.call("POST", f"{BASE}/proposals/{proposal['id']}/approve", ADMIN,
                                   {"reason": "approved at B"})
    assert status == 200, approved
    assert approved["status"] in ("approved", "applied") and approved["decided_by"] == "bootstrap-admin"
    # Sent again: the owner refuses it (decided already); nothing is applied twice.
    status, again = pair.b.call("POST", f"{BASE}/proposals/{proposal['id']}/approve", ADMIN, {})
    assert status == 409, again
    placement = pair.get(pair.a, BASE)["placement"]
    assert placement["shares"] == [20, 12]
    status, body = pair.b.call("PUT", f"{BASE}/overrides", ADMIN, {"pins": {"0": 20}, "reason": "pin at B"})
    assert status == 200, body
    assert pair.get(pair.a, f"{BASE}/overrides")["pins"] == {"0": 20}

    audit = pair.get(pair.a, f"/api/v1/audit?job={JOB}&limit=5000")["data"]
    approvals = [r for r in audit if r["action"] == "proposal.approve"
                 and r["params"].get("proposal_id") == proposal["id"]]
    assert len(approvals) == 1, audit
    assert approvals[0]["actor"] == "bootstrap-admin" and approvals[0]["reason"] == "approved at B"
    assert [r["action"] for r in audit].count("job.overrides") == 1, audit
    assert pair.counter(pair.b, "rebalancer_forwarded_requests_total", "answered") >= 5
    # The placement versions: 0, and the one approved through B (no second one).
    assert [p["shares"] for p in pair.get(pair.b, f"{BASE}/placements")["data"]] == [[20, 12], [16, 16]]


def test_when_forwarding_is_impossible_the_caller_is_told_why(pair: Pair) -> None:
    owner = pair.redis.get(f"{pair.prefix}:lease:{JOB}").decode()
    # A request that was forwarded once is never forwarded again: the old 409.
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{pair.b.url}{BASE}/mode", method="PUT",
                                 data=json.dumps({"mode": "approve"}).encode(),
                                 headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json",
                                          "X-Rebalancer-Forwarded-By": "elsewhere"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 409
    assert json.loads(refused.value.read())["detail"] == (
        f"Job '{JOB}' is controlled by replica {owner} at {pair.a.ws_url}; send this action there.")
    # An owner nobody can reach (its lease not expired yet): 503 with the reason, nothing applied.
    dead = f"ws://127.0.0.1:{free_port()}"
    pair.redis.set(f"{pair.prefix}:replica:ghost-owner", dead, px=60_000)
    pair.redis.set(f"{pair.prefix}:lease:ghost", "ghost-owner", px=60_000)
    status, body = pair.b.call("PUT", "/api/v1/jobs/ghost/mode", ADMIN, {"mode": "auto"})
    assert status == 503, body
    assert body["detail"] == (
        f"Job 'ghost' is controlled by replica ghost-owner at {dead}, which cannot be reached (ConnectError); "
        "nothing was applied. Try again: once its lease expires (REBALANCER_LEASE_TTL_S) another replica "
        "takes the job.")


def _watcher_with_a_copy() -> Any:
    """A hub that watches job 'j' and holds a copy of another hub's feed of it."""
    from backend.dashboard import remote
    from tests.backend.test_hub import _feed, _hub, _register, _services

    svc = _services()
    _register(svc.live)
    owner, watcher = _hub(svc), _hub(_services())
    for b in range(5):
        _feed(svc.live, b)
    owner.notify("j")
    owner.tick()
    _, text = owner.snapshot("j", replica="a", seq=1)
    assert watcher.apply_remote("j", remote.check("j", text))
    return watcher


def test_notices_are_read_only_when_small_well_formed_and_for_a_watched_job() -> None:
    import asyncio

    from backend.cluster import LiveFanout
    from tests.backend.test_hub import FakeSocket

    async def run() -> None:
        watcher = _watcher_with_a_copy()
        fanout = LiveFanout(url=REDIS_URL, prefix="unused", replica_id="b", interval_s=1.0, hub=watcher,
                            owned=set)
        task = asyncio.create_task(watcher.attach(FakeSocket().send, "j"))
        await asyncio.sleep(0)
        assert fanout._message(json.dumps({"job": "j", "kind": "live", "seq": 2, "replica": "a"})) == "j"
        assert fanout._message(json.dumps({"job": "k", "kind": "live", "seq": 2, "replica": "a"})) is None
        assert fanout._message(json.dumps({"job": "j", "kind": "owner", "replica": "a"})) is None
        assert fanout._message(json.dumps({"job": "j", "kind": "live", "seq": 2, "replica": "b"})) is None
        assert fanout._message(b"{not json") is None
        assert fanout._message(json.dumps({"job": "j", "kind": "live", "pad": "x" * 8000})) is None
        assert fanout.refused == 2
        task.cancel()
        await fanout.stop()
    asyncio.run(run())


def test_with_redis_down_a_watcher_keeps_its_last_copy() -> None:
    import asyncio

    from backend.cluster import LiveFanout
    from tests.backend.test_hub import FakeSocket, _settle

    async def run() -> None:
        watcher = _watcher_with_a_copy()
        fanout = LiveFanout(url=f"redis://127.0.0.1:{free_port()}/0", prefix="p", replica_id="b",
                            interval_s=0.1, hub=watcher, owned=set)
        sock = FakeSocket()
        client = asyncio.create_task(watcher.attach(sock.send, "j"))
        await fanout.start()
        await asyncio.sleep(0.5)  # several passes, each meeting the dead Redis
        assert fanout._task is not None and not fanout._task.done()
        await _settle()
        assert sock.frames[0]["series"]["b"] == [0, 1, 2, 3, 4]  # the copy is still shown
        assert watcher.remote_jobs() == {"j"}
        await fanout.stop()
        assert fanout._task.done()
        client.cancel()
    asyncio.run(run())


def test_the_http_base_of_an_advertised_url() -> None:
    from backend.cluster.forward import http_base

    assert http_base("ws://10.0.0.5:8000") == "http://10.0.0.5:8000"
    assert http_base("wss://gpu-head.example/replica/0f3a9c21b7de/") == "https://gpu-head.example/replica/0f3a9c21b7de"
    assert http_base("http://h:1") == "http://h:1"
    for bad in ("10.0.0.5:8000", "ftp://h", "ws://", "ws://h?x=1", "ws://a,ws://b"):
        assert http_base(bad) is None, bad


def test_a_bad_snapshot_on_redis_costs_only_its_own_job_one_update() -> None:
    import asyncio

    from backend.cluster import LiveFanout

    watcher = _watcher_with_a_copy()  # holds a good copy of job 'j'
    with redis_under_prefix() as (prefix, client):
        client.set(f"{prefix}:live:bad", "[" * 100_000 + "]" * 100_000, px=60_000)  # nested past recursion
        client.set(f"{prefix}:live:worse", json.dumps({"job": "worse", "seq": "1"}), px=60_000)

        async def run() -> None:
            fanout = LiveFanout(url=REDIS_URL, prefix=prefix, replica_id="b", interval_s=1.0, hub=watcher,
                                owned=set)
            assert not await fanout.pull("bad")
            assert not await fanout.pull("worse")
            assert not await fanout.pull("absent")  # no snapshot stored: nothing changes
            assert fanout.refused == 2 and fanout.applied == 0
            await fanout.stop()
        asyncio.run(run())
        assert watcher.remote_jobs() == {"j"} and watcher.savings("j") is not None


def test_every_replica_lists_every_job_of_the_cluster_in_its_fleet(pair: Pair) -> None:
    # B holds no rank of JOB: its fleet (REST and the home page's overview frame) lists JOB
    # with A's figures, shared through Redis by A's fan-out pass.
    def listed(server: Server) -> dict | None:
        rows = {r["job"]: r for r in pair.get(server, "/api/v1/fleet")["data"]}
        return rows.get(JOB)

    at_b = wait_until(lambda: listed(pair.b), "replica B's fleet to list the job replica A controls", log=pair.log)
    at_a = listed(pair.a)
    assert at_a is not None
    keys = ("status", "mode", "world_size", "connected_ranks", "devices")
    assert {k: at_b[k] for k in keys} == {k: at_a[k] for k in keys}
    assert at_b["world_size"] == 2 and at_b["connected_ranks"] == 2
    assert pair.get(pair.b, "/api/v1/fleet")["totals"]["ranks"] >= 2
    # B's job list (read from its database) carries A's live figures for the job too.
    def entry(server: Server) -> dict:
        return {j["job"]: j for j in pair.get(server, "/api/v1/jobs")["data"]}[JOB]

    keys = ("batch_index", "connected_ranks", "world_size", "status", "mode")

    def same() -> dict | None:  # the fan-out runs every 0.2 s here: B follows A within it
        b, a = entry(pair.b), entry(pair.a)
        return b if all(b[k] == a[k] for k in keys) else None

    listed_b = wait_until(same, "replica B's job list to show A's figures", log=pair.log)
    assert listed_b["connected_ranks"] == 2 and listed_b["batch_index"] is not None
    headers = {"Authorization": f"Bearer {ADMIN}"}
    with connect(f"{pair.b.ws_url}/ws/dashboard", additional_headers=headers) as ws:
        frame = json.loads(ws.recv(timeout=20))
        assert frame["type"] == "overview"
        assert JOB in [s["job"] for s in frame["jobs"]] and JOB in [r["job"] for r in frame["fleet"]["data"]]


def test_a_bad_or_stale_fleet_entry_on_redis_costs_only_its_own_job() -> None:
    import asyncio
    import time

    from backend.cluster import LiveFanout
    from tests.backend.test_hub import _feed, _hub, _register, _services

    with redis_under_prefix() as (prefix, client):
        svc = _services()
        _register(svc.live)
        for b in range(5):
            _feed(svc.live, b)
        owner, watcher = _hub(svc), _hub(_services())
        owner.notify("j")
        owner.tick()
        key = f"{prefix}:fleet"
        good = {"replica": "c", "t": time.time(), "summary": {"job": "k"}, "row": {
            "job": "k", "status": "running", "status_detail": "", "mode": "auto", "world_size": 4,
            "connected_ranks": 4, "devices": [["H100", 4]], "wasted_ms": 0.0, "step_ms": 100.0,
            "balance_gap_ms": None, "saved_s": None, "saved_cost": None, "cost_per_hour": None,
            "imbalance": 0.1, "eta_s": None, "batch_index": 7, "bound": "compute", "pending_proposal_id": None}}
        client.hset(key, mapping={
            "k": json.dumps(good),
            "nested": "[" * 100_000 + "]" * 100_000,  # over the size bound
            "deep": "[" * 20_000 + "]" * 20_000,  # within it, past the parser's depth
            "typed": json.dumps({**good, "row": {**good["row"], "job": "typed", "world_size": "4"}}),
            "other": json.dumps({**good, "row": {**good["row"], "job": "not-other"}}),
            "old": json.dumps({**good, "t": time.time() - 3600, "summary": {"job": "old"},
                               "row": {**good["row"], "job": "old"}}),
        })

        async def run() -> None:
            a = LiveFanout(url=REDIS_URL, prefix=prefix, replica_id="a", interval_s=1.0, hub=owner, owned=lambda: {"j"})
            b = LiveFanout(url=REDIS_URL, prefix=prefix, replica_id="b", interval_s=1.0, hub=watcher, owned=set)
            await a.pass_once()  # stores j's entry; reads k (and refuses the bad ones)
            await b.pass_once()
            assert b.refused == 4  # nested, deep, typed, other: each its own job's, once
            await b.pass_once()
            assert b.refused == 4  # logged once per job, not every pass
            await a.stop()
            await b.stop()
        asyncio.run(run())
        rows = {r["job"]: r for r in watcher.fleet()["data"]}
        assert sorted(rows) == ["j", "k"]  # the owner's job and the good entry
        assert rows["j"] == {r["job"]: r for r in owner.fleet()["data"]}["j"]  # the owner's own figures
        assert (rows["k"]["world_size"], rows["k"]["devices"], rows["k"]["bound"]) == (4, [{"kind": "H100", "count": 4}],
                                                                                      "compute")
        assert client.hexists(key, "old") is False  # stale: deleted
        assert client.hexists(key, "nested")  # refused, left for its owner to rewrite
        assert sorted(r["job"] for r in owner.fleet()["data"]) == ["j", "k"]
        # /metrics' fleet series stay each replica's own jobs (summed over replicas: once each).
        assert [r["job"] for r in owner.fleet(own=True)["data"]] == ["j"]
        assert watcher.fleet(own=True)["totals"]["jobs"] == 0


def test_every_replica_says_which_replica_owns_the_job(pair: Pair) -> None:
    # Operators see which replica controls a job: REST (either replica, one answer), /healthz
    # (the jobs each holds) and the dashboards' summaries (job view and fleet view).
    health_a, health_b = pair.get(pair.a, "/healthz"), pair.get(pair.b, "/healthz")
    assert health_a["replica_id"] and health_b["replica_id"] and health_a["replica_id"] != health_b["replica_id"]
    owner = {"replica_id": health_a["replica_id"], "url": f"ws://127.0.0.1:{pair.a.port}"}
    assert pair.get(pair.a, BASE)["owner"] == owner
    assert pair.get(pair.b, BASE)["owner"] == owner
    assert health_a["jobs_owned"] >= 1 and health_b["jobs_owned"] == 0  # every hook of this module is at A
    headers = {"Authorization": f"Bearer {ADMIN}"}
    for server in (pair.a, pair.b):
        with connect(f"{server.ws_url}/ws/dashboard?job={JOB}", additional_headers=headers) as ws:
            view = _frames(ws, lambda v: v["summary"] is not None, "the job's summary")
            assert view["summary"]["owner"] == owner
        with connect(f"{server.ws_url}/ws/dashboard", additional_headers=headers) as ws:
            frame = json.loads(ws.recv(timeout=20))
            assert {s["job"]: s.get("owner") for s in frame["jobs"]}[JOB] == owner

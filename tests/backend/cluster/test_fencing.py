"""Lease fencing with real replicas (issue 38): two ``rebalancer serve`` processes on one
PostgreSQL schema of their own and the real Redis under a key prefix of their own, one pair
for the module.

The defect: replica A, the owner, starts an operator's placement; its database write stalls
(here a lock the test holds on the placements table) and A is paused (SIGSTOP) past its
lease; B takes the job. A, resumed, used to commit the placement and answer 201 while B
controlled the job, and the store of record and B disagreed. Now A's write is refused in its
own transaction (409, nothing applied) and the store and B agree.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.cluster import Replicas, redis_or_skip, running_replicas

redis_or_skip()

from sqlalchemy import create_engine, text  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from tests.backend._app import hello  # noqa: E402
from tests.helpers.server import Server  # noqa: E402
from tests.helpers.waiting import wait_until  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

ADMIN = "fencing-admin-secret-0123456789ab"
TTL_S = 2.0


class Pair(Replicas):
    def epoch(self, job: str) -> int:
        return int(self.redis.get(f"{self.prefix}:epoch:{job}") or 0)

    def replica_id(self, server: Server) -> str:
        [key] = [k.decode() for k in self.redis.scan_iter(f"{self.prefix}:replica:*")
                 if self.redis.get(k) == server.ws_url.encode()]
        return key.rsplit(":", 1)[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    env = {"REBALANCER_ADMIN_TOKEN": ADMIN, "REBALANCER_DEFAULT_MODE": "approve", "REBALANCER_PERSIST_INTERVAL_S": "0.5"}
    with running_replicas(tmp_path_factory.mktemp("fencing"), env, ttl_s=TTL_S) as replicas:
        yield Pair(**vars(replicas))


def _call(server: Server, method: str, path: str, body: object = None, timeout: float = 60.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _rank(server: Server, job: str) -> Any:
    """A rank of ``job`` (world size 2, global batch 32) connected to ``server``."""
    ws = connect(f"{server.ws_url}/ws/hook", additional_headers={"Authorization": f"Bearer {ADMIN}"})
    ws.send(hello(job, rank=0, world_size=2, global_batch_size=32))
    assert json.loads(ws.recv(timeout=20))["type"] == "placement"
    return ws


def test_a_stalled_then_paused_owner_cannot_commit_after_another_replica_took_the_job(pair: Pair) -> None:
    job, base = "stalled", "/api/v1/jobs/stalled"
    a, b = pair.a, pair.b
    rank = _rank(a, job)
    try:
        wait_until(lambda: pair.lease(job) is not None, "replica A to take the job", 20, log=pair.log)
        owner_a, epoch_a = pair.lease(job), pair.epoch(job)
        assert owner_a == pair.replica_id(a)
        engine = create_engine(pair.db_url)
        with engine.connect() as lock:
            # Stall every insert into the placements table (reads go on).
            lock.execute(text("LOCK TABLE control_placements IN SHARE ROW EXCLUSIVE MODE"))
            reply: dict[str, Any] = {}
            action = threading.Thread(target=lambda: reply.update(got=_call(a, "POST", f"{base}/proposals", {
                "shares": [20, 12], "apply": True, "reason": "placed by the stalled owner"})))
            action.start()

            def waiting() -> bool:
                return bool(lock.execute(text(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted "
                    "AND relation = 'control_placements'::regclass")).scalar())

            wait_until(waiting, "replica A's placement write to wait for the lock", 30, log=pair.log)
            os.kill(a.proc.pid, signal.SIGSTOP)  # paused past its lease, mid-write
            wait_until(lambda: pair.lease(job) is None, f"A's {TTL_S:g} s lease to expire", 10 + TTL_S,
                       interval=0.05, log=pair.log)
            # Nobody leases the job: an action at B takes it (a new epoch) and is applied there.
            status, body = _call(b, "PUT", f"{base}/mode", {"mode": "approve", "reason": "B takes the job"})
            assert status == 200, body
            owner_b, epoch_b = pair.lease(job), pair.epoch(job)
            assert owner_b == pair.replica_id(b) and epoch_b == epoch_a + 1
            moved = _rank(b, job)  # the rank reaches B too (B keeps the job while it is connected)
            lock.rollback()  # the write goes on, A still paused
        engine.dispose()
        os.kill(a.proc.pid, signal.SIGCONT)
        action.join(60)
        assert reply["got"] == (409, {"detail": (
            f"Replica {owner_a} no longer owns job '{job}' (lease epoch {epoch_a} < {epoch_b}); nothing was "
            "applied. Retry: the request will be forwarded to the owner.")}), pair.log()
        # The store of record and B agree: version 0 is in force, A's placement is nowhere.
        assert [p["version"] for p in _call(b, "GET", f"{base}/placements")[1]["data"]] == [0]
        assert _call(b, "GET", base)[1]["placement"] == {"version": 0, "shares": [16, 16]}
        # The retry at A goes to B, the owner, and is applied once.
        wait_until(lambda: _call(a, "GET", f"{base}/placements")[0] == 200, "A to answer again", 20, log=pair.log)
        status, body = _call(a, "POST", f"{base}/proposals", {"shares": [20, 12], "apply": True,
                                                               "reason": "sent again"})
        assert status == 201, body
        placements = _call(b, "GET", f"{base}/placements")[1]["data"]
        assert sorted((p["version"], tuple(p["shares"])) for p in placements) == [(0, (16, 16)), (1, (20, 12))]
        assert _call(b, "GET", base)[1]["placement"] == {"version": 1, "shares": [20, 12]}
        assert pair.lease(job) == owner_b
        moved.close()
    finally:
        rank.close()


def _stored_batches(db_url: str, job: str, rank: int) -> set[int]:
    """Every batch index of ``rank`` that some stored metric window covers."""
    engine = create_engine(db_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT batch_index_start, batch_index_end FROM rank_metrics "
                                 "WHERE job = :job AND rank = :rank"), {"job": job, "rank": rank}).all()
    engine.dispose()
    return {k for lo, hi in rows for k in range(int(lo), int(hi) + 1)}


def test_a_paused_owner_loses_at_most_the_persist_interval_of_metrics(pair: Pair) -> None:
    """The owner is paused (SIGSTOP) with two ranks streaming to it, then killed while paused.
    The ranks' transports notice the silence, go to B and send again what A never confirmed;
    only what A had read and not stored yet (one persist interval, 0.5 s here) may be lost."""
    import time

    from rebalancer_wire.protocol import Hello, StepRecord
    from trainer_hook.transport import Transport

    job, steps_per_s, persist_s = "paused-owner", 50, 0.5
    a, b = pair.a, pair.b
    produced = [0, 0]
    stop = threading.Event()

    def rank_hello(rank: int) -> Any:
        return lambda: Hello(job=job, rank=rank, world_size=2, global_batch_size=32, device_type="cpu",
                             batch_index=produced[rank])

    transports = [Transport(url=f"{a.url},{b.url}", token=ADMIN, hello=rank_hello(r), on_message=lambda m: None,
                            flush_interval_s=0.1, backoff_initial_s=0.1, backoff_max_s=0.5,
                            open_timeout_s=2.0, silent_timeout_s=2.0) for r in range(2)]

    def train(rank: int) -> None:
        t = transports[rank]
        while not stop.is_set():
            k = produced[rank]
            t.put_step(StepRecord(batch_index=k, local_batch_size=16, placement_version=0, data_wait_ms=0.1,
                                  compute_ms=5.0, sync_wait_ms=10.0, optimizer_ms=1.0,
                                  step_ms=1000 / steps_per_s, t=time.time()))
            produced[rank] = k + 1
            time.sleep(1 / steps_per_s)

    for t in transports:
        t.start()
    trainers = [threading.Thread(target=train, args=(r,), daemon=True) for r in range(2)]
    for th in trainers:
        th.start()
    try:
        wait_until(lambda: pair.lease(job) == pair.replica_id(a) and _call(a, "GET", f"/api/v1/jobs/{job}")[1]
                   .get("connected_ranks") == 2, "both ranks on A, the owner", 30, log=pair.log)
        time.sleep(1.0)
        os.kill(a.proc.pid, signal.SIGSTOP)
        paused = time.monotonic()
        wait_until(lambda: pair.lease(job) == pair.replica_id(b)
                   and _call(b, "GET", f"/api/v1/jobs/{job}")[1].get("connected_ranks") == 2,
                   "B to take the job with both ranks", 60, interval=0.1, log=pair.log)
        print(f"[failover] both ranks on B {time.monotonic() - paused:.1f} s after the owner's pause")
        a.proc.kill()  # killed while paused: what it read and had not stored is gone
        a.proc.wait()
        time.sleep(1.0)
    finally:
        stop.set()
        for th in trainers:
            th.join(5)
        for t in transports:
            t.close(timeout=5.0)
    time.sleep(2 * persist_s + 0.5)  # B stores what it got
    for rank in range(2):
        stored = _stored_batches(pair.db_url, job, rank)
        missing = sorted(set(range(produced[rank])) - stored)
        lost_s = len(missing) / steps_per_s
        print(f"[failover] rank {rank}: {produced[rank]} steps, {len(missing)} never stored ({lost_s:.2f} s)")
        assert lost_s <= persist_s + 0.1, (missing[:5], missing[-5:], pair.log())

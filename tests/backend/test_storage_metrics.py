"""Jobs, ranks, downsampled metrics and tokens on SQLite and on the local PostgreSQL server.

PostgreSQL runs each test in its own schema (``search_path`` in the URL), so the shared
``test`` database stays clean whatever other tests do.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from backend.live.state import LiveState
from backend.parts import init_db
from backend.storage import make_engine, make_sessionmaker
from backend.storage import metrics as store
from rebalancer_wire.protocol import Hello, Metrics
from tests.backend._app import hello, make_app, metrics, steps, sync


def _hello(rank: int, **kw) -> Hello:
    return Hello(job="j", rank=rank, world_size=2, global_batch_size=32, host=f"node{rank}", **kw)


def test_hello_upsert_and_windows_round_trip(db_url):
    engine = make_engine(db_url)
    init_db(engine)
    sf = make_sessionmaker(engine)
    live = LiveState(window_steps=5)
    with sf() as s:
        for r in (0, 1):
            live.register(_hello(r))
            store.upsert_hello(s, _hello(r, device_name="cpu"))
        store.upsert_hello(s, _hello(1, device_name="renamed", mem_total_bytes=8 << 30))
        s.commit()
    live.add_metrics(Metrics(job="j", rank=0, steps=steps(0, 10, compute_ms=10.0, step_ms=30.0)))
    # Rank 1's steps carry communication counters (half of them a comm time); rank 0's none.
    comm = [replace(x, comm_bytes=4_000_000, comm_ms=2.0 if x.batch_index % 2 else None)
            for x in steps(0, 10, compute_ms=25.0, step_ms=30.0)]
    live.add_metrics(Metrics(job="j", rank=1, steps=comm, dropped=4))
    first = live.drain_windows()
    live.add_metrics(Metrics(job="j", rank=0, steps=steps(10, 5, compute_ms=12.0, step_ms=30.0)))
    second = live.drain_windows()
    assert live.drain_windows() == []
    with sf() as s:
        assert store.insert_windows(s, first + second) == 3
        s.commit()
    with sf() as s:
        jobs = store.list_jobs(s)
        assert [(j.name, j.world_size, j.global_batch_size) for j in jobs] == [("j", 2, 32)]
        ranks = store.list_ranks(s, "j")
        assert [(r.rank, r.host, r.device_name) for r in ranks] == [(0, "node0", "cpu"), (1, "node1", "renamed")]
        assert ranks[1].mem_total_bytes == 8 << 30
        rows = store.query_metrics(s, "j")
        assert [(m.rank, m.batch_index_start, m.batch_index_end, m.n_steps) for m in rows] == [
            (0, 0, 9, 10), (1, 0, 9, 10), (0, 10, 14, 5)]
        assert rows[1].compute_ms == pytest.approx(25.0) and rows[1].dropped == 4
        # Communication is stored with the window; absent counters stay absent, never 0.
        assert (rows[1].comm_bytes, rows[1].comm_ms) == (4_000_000, pytest.approx(2.0))
        assert (rows[0].comm_bytes, rows[0].comm_ms) == (None, None)
        assert [m.batch_index_end for m in store.query_metrics(s, "j", ranks=[0], batch_from=10)] == [14]
        assert store.query_metrics(s, "j", batch_to=3, ranks=[1])[0].rank == 1
        assert store.query_metrics(s, "missing") == []
    engine.dispose()


def test_history_survives_a_backend_restart(db_url, tmp_path):
    app = make_app(tmp_path, db=db_url)
    with TestClient(app) as c:
        with c.websocket_connect("/ws/hook") as ws:
            ws.send_text(hello(rank=0, world_size=1, global_batch_size=8))
            ws.receive_json()
            ws.send_text(metrics(rank=0, n=6, compute_ms=7.0, local_batch_size=8))
            sync(ws, hello(rank=0, world_size=1, global_batch_size=8))
    # The lifespan's stop flushes what the flusher had not written yet.
    with TestClient(make_app(tmp_path, db=db_url)) as c:
        job = c.get("/api/v1/jobs/j").json()
        assert (job["world_size"], job["global_batch_size"], job["status"]) == (1, 8, "idle")
        ranks = c.get("/api/v1/jobs/j/ranks").json()["data"]
        assert ranks[0]["batch_index"] == 5 and ranks[0]["compute_ms"] == pytest.approx(7.0)
        hist = c.get("/api/v1/jobs/j/metrics").json()
        assert hist["source"] == "history" and hist["count"] == 1
        assert hist["data"][0]["n_steps"] == 6 and hist["data"][0]["batch_index_start"] == 0
        assert c.get("/api/v1/jobs").json()["count"] == 1

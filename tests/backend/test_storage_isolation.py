"""One job's bad row never costs another job its stored history (issue 15, defect 1).

The write buffer on SQLite and the local PostgreSQL: rows the database refuses are dropped
alone and counted; rows that meet a database fault wait and are written on the next try;
past its bound the buffer drops the oldest, counted. Then the real server, with a row that
reaches SQL and fails there beside another job's good rows in the same save.
"""

from __future__ import annotations

import json
import sqlite3

import pytest
from sqlalchemy import create_engine, func, select
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from backend.live.windows import Window
from backend.parts import init_db
from backend.storage import RankMetricRow, insert_windows, make_engine, make_sessionmaker
from backend.storage.writes import WriteBuffer
from tests.backend._app import joined, metrics
from tests.helpers.server import running_server


def _window(job: str, rank: int, first: int, **bad: object) -> Window:
    w = dict(job=job, rank=rank, t_start=1.7e9 + first, t_end=1.7e9 + first + 1,
             batch_index_start=first, batch_index_end=first + 9, n_steps=10, placement_version=0,
             local_batch_size=16.0, compute_ms=10.0, sync_wait_ms=5.0, data_wait_ms=1.0,
             optimizer_ms=1.0, step_ms=17.0, dropped=0, device=None)
    w.update(bad)
    return Window(**w)  # type: ignore[arg-type]


def _buffer(**kw: object) -> WriteBuffer:
    return WriteBuffer(write_rows=insert_windows, job_of=lambda w: w.job, **kw)  # type: ignore[arg-type]


def _stored(sf, job: str) -> int:
    with sf() as s:
        return int(s.scalar(select(func.count()).select_from(RankMetricRow).where(RankMetricRow.job == job)))


@pytest.mark.parametrize("bad", [
    {"batch_index_end": 2**63},  # beyond int64: OverflowError (SQLite) or out of range (PostgreSQL)
    {"batch_index_start": -(2**64)},
    {"dropped": 10**30},
])
def test_bad_row_costs_only_itself(db_url, bad):
    engine = make_engine(db_url)
    init_db(engine)
    sf = make_sessionmaker(engine)
    buf = _buffer()
    buf.add([_window("a", 0, 0), _window("a", 1, 0), _window("b", 0, 0, **bad), _window("b", 1, 0),
             _window("c", 0, 0)])
    out = buf.write(sf)
    assert (out.written, out.refused, out.kept, out.fault) == (4, 1, 0, None)
    assert (_stored(sf, "a"), _stored(sf, "b"), _stored(sf, "c")) == (2, 1, 1)
    assert buf.dropped_total == 1 and len(buf) == 0
    engine.dispose()


def test_database_fault_keeps_rows_until_it_takes_writes_again(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'r.db'}")
    init_db(engine)
    sf = make_sessionmaker(engine)
    away = create_engine(f"sqlite:///{tmp_path / 'missing' / 'r.db'}")  # cannot be opened
    buf = _buffer()
    buf.add([_window("a", 0, 0), _window("b", 0, 0)])
    out = buf.write(make_sessionmaker(away))
    assert out.fault is not None and "unable to open database file" in out.fault
    assert (out.written, out.kept, buf.dropped_total) == (0, 2, 0)
    buf.add([_window("a", 0, 10)])
    assert len(buf) == 3
    out = buf.write(sf)
    assert (out.written, out.fault, buf.fault) == (3, None, None)
    with sf() as s:  # in order: the retried rows first
        firsts = list(s.scalars(select(RankMetricRow.batch_index_start)
                                .where(RankMetricRow.job == "a").order_by(RankMetricRow.id)))
    assert firsts == [0, 10]
    engine.dispose()
    away.dispose()


def test_bound_drops_the_oldest_and_counts_them():
    buf = _buffer(max_windows=3)
    buf.add([_window("a", 0, i * 10) for i in range(5)])
    assert len(buf) == 3 and buf.dropped_total == 2


@pytest.mark.multiproc
def test_real_server_bad_frame_of_one_job_keeps_the_other_jobs_history(tmp_path):
    """The issue's case: a frame whose values the database cannot store, sent as another job
    in the same save as a good job's steps. The edge may refuse it (4002) or accept it; either
    way every good step is stored and the good job's connection stays open."""
    env = {"REBALANCER_PERSIST_INTERVAL_S": "3600"}  # one save, at shutdown: same transaction
    with running_server(tmp_path, env=env) as server:
        url = server.ws_url + "/ws/hook"
        with connect(url) as good:
            joined(good, "good")
            good.send(metrics(job="good", rank=0, first=0, n=20))
            with connect(url) as bad:
                joined(bad, "evil")
                frame = json.loads(metrics(job="evil", rank=0, first=0, n=5))
                frame["steps"][0]["t"] = 1e308
                frame["steps"][1]["batch_index"] = 2**63
                bad.send(json.dumps(frame))
                replies = []
                with pytest.raises((ConnectionClosed, TimeoutError)):  # refused (closed) or ignored
                    while True:
                        replies.append(json.loads(bad.recv(timeout=2))["type"])
                assert set(replies) <= {"error"}, replies  # at most the refusal, nothing else
            good.send(metrics(job="good", rank=0, first=20, n=20))
            joined(good, "good")  # still served
        metrics_text = urllib_get(server.url + "/metrics")
    db = sqlite3.connect(tmp_path / "rebalancer.db")
    steps = db.execute("SELECT SUM(n_steps) FROM rank_metrics WHERE job = 'good'").fetchone()[0]
    db.close()
    assert steps == 40, server.log()[-3000:]
    assert "rebalancer_persist_dropped_windows_total" in metrics_text


def urllib_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()

"""Hellos are stored by the batch (``HelloWriter``, group commit): a node's or a job's ranks
saying hello together cost one transaction and a few statements, not one transaction (and
four statements) per rank. Counted on the engine (SQLAlchemy events), on SQLite and on the
local PostgreSQL server; and through /ws/hook, where a node connection's eight hellos, sent
together, are one transaction."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from backend.parts import init_db
from backend.storage import make_engine, make_sessionmaker
from backend.storage import metrics as store
from backend.storage.gateway import SqlGateway
from backend.storage.hellos import HelloWriter
from rebalancer_wire.protocol import Hello
from tests.backend._app import hello, make_app
from tests.helpers.postgres import pg_schema


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request, tmp_path: Path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'rebalancer.db'}"
        return
    with pg_schema() as url:
        yield url


class _Count:
    """Transactions committed and statements run on ``engine``."""

    def __init__(self, engine) -> None:
        self.commits = 0
        self.statements = 0
        event.listen(engine, "commit", self._commit)
        event.listen(engine, "before_cursor_execute", self._statement)

    def _commit(self, conn) -> None:
        self.commits += 1

    def _statement(self, conn, cursor, statement, parameters, context, executemany) -> None:
        self.statements += 1


def _hello(job: str, rank: int, world: int, **kw) -> Hello:
    return Hello(job=job, rank=rank, world_size=world, global_batch_size=8 * world, host=f"node{rank // 8}",
                 device_type="H100", **kw)


def test_a_jobs_hellos_together_are_one_transaction(db_url):
    engine = make_engine(db_url)
    init_db(engine)
    sql = SqlGateway(make_sessionmaker(engine))
    writer = HelloWriter(sql)
    count = _Count(engine)

    async def say_hello(hellos: list[Hello]) -> None:
        await asyncio.gather(*(writer.store(h) for h in hellos))

    try:
        # 256 ranks of one job and 64 of another, as their node agents connect at once.
        asyncio.run(say_hello([_hello("big", r, 256) for r in range(256)] + [_hello("small", r, 64) for r in range(64)]))
        assert (writer.batches, writer.stored) == (1, 320)
        assert count.commits == 1
        # A SELECT of the jobs, one of each job's ranks, the jobs' INSERT, the ranks' bulk
        # INSERT (a few statements on PostgreSQL's insertmanyvalues), never one per rank.
        assert count.statements <= 10, count.statements
        # Again after a restart: every rank is known, its row updated in the same one transaction.
        commits, statements = count.commits, count.statements
        asyncio.run(say_hello([_hello("big", r, 256, restart_count=1, pid=1000 + r) for r in range(256)]))
        assert count.commits - commits == 1
        assert count.statements - statements <= 10, count.statements - statements
    finally:
        sql.close()
    with make_sessionmaker(engine)() as s:
        big = store.list_ranks(s, "big")
        assert [r.rank for r in big] == list(range(256))
        assert all(r.restart_count == 1 and r.pid == 1000 + r.rank for r in big)
        assert big[17].host == "node2" and big[17].device_type == "H100"
        assert len(store.list_ranks(s, "small")) == 64
        assert {j.name: (j.world_size, j.global_batch_size) for j in store.list_jobs(s)} == {
            "big": (256, 2048), "small": (64, 512)}
    engine.dispose()


def test_the_last_hello_of_a_rank_in_a_batch_wins(db_url):
    engine = make_engine(db_url)
    init_db(engine)
    with make_sessionmaker(engine)() as s:
        store.upsert_hellos(s, [_hello("j", 0, 4, device_name="first"), _hello("j", 1, 4),
                                _hello("j", 0, 4, device_name="second"), _hello("j", 1, 8)])
        s.commit()
        ranks = {r.rank: r for r in store.list_ranks(s, "j")}
        assert ranks[0].device_name == "second" and set(ranks) == {0, 1}
        assert store.get_job(s, "j").world_size == 8  # the job's newest hello says its shape
    engine.dispose()


def test_a_failed_batch_fails_each_of_its_hellos(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'r.db'}")  # no tables: every statement fails
    sql = SqlGateway(make_sessionmaker(engine))
    writer = HelloWriter(sql)

    async def say_hello() -> list[object]:
        return await asyncio.gather(*(writer.store(_hello("j", r, 4)) for r in range(4)), return_exceptions=True)

    try:
        outcomes = asyncio.run(say_hello())
    finally:
        sql.close()
        engine.dispose()
    assert len(outcomes) == 4 and all(isinstance(o, Exception) for o in outcomes), outcomes
    assert writer.batches == 0


def test_a_node_connections_hellos_are_one_transaction(tmp_path):
    app = make_app(tmp_path)
    with TestClient(app) as client:
        parts = app.state.parts
        with client.websocket_connect("/ws/hook") as ws:
            for r in range(8):  # the node agent says hello for its eight ranks at once
                ws.send_text(hello(job="node", rank=r, world_size=8, global_batch_size=64))
            replies = [ws.receive_json() for _ in range(8)]
            assert [m["type"] for m in replies] == ["placement"] * 8
            assert {tuple(m["shares"]) for m in replies} == {(8,) * 8}
        assert parts.hellos.stored == 8
        # The first hello is written at once; the seven read while it was written go in one
        # more (or in the same) transaction: at most two, never eight.
        assert parts.hellos.batches <= 2, parts.hellos.batches
        assert [r["rank"] for r in client.get("/api/v1/jobs/node/ranks").json()["data"]] == list(range(8))

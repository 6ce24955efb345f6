"""Control tables on a real SQLite file and on the local PostgreSQL server."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import IntegrityError

from backend.auth.tokens import Actor
from backend.parts import init_db
from backend.storage import control as db
from backend.storage.base import make_engine, make_sessionmaker
from tests.helpers.postgres import pg_schema


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def sessions(request, tmp_path):
    if request.param == "sqlite":
        engine = make_engine(f"sqlite:///{tmp_path / 'control.db'}")
        init_db(engine)
        yield make_sessionmaker(engine), "job-a"
        engine.dispose()
        return
    with pg_schema() as url:  # a schema of its own: the PostgreSQL database is shared
        engine = make_engine(url)
        init_db(engine)
        yield make_sessionmaker(engine), "job-a"
        engine.dispose()


def test_rows_round_trip_and_read_back_newest_first(sessions):
    sm, job = sessions
    with sm() as s:
        s.add(db.JobRow(name=job, world_size=3, global_batch_size=48, mode="auto",
                        policy={"strategy": "static", "min_gain": 0.1}))
        s.add(db.PlacementRow(job=job, version=0, shares=[16, 16, 16], source="initial", acks={}))
        s.add(db.PlacementRow(job=job, version=1, shares=[20, 20, 8], previous_shares=[16, 16, 16],
                              previous_version=0, source="manual", acks={"0": 7, "2": 7, "1": 7},
                              effective_batch_index=7, step_ms_before=80.0, step_ms_after=40.0,
                              measured_gain=0.5))
        s.add(db.PlacementRow(job=job, version=2, shares=[24, 24, 0], source="policy", failed=True,
                              error="rank 0 rejected it", acks={}))
        for shares, status in (([20, 20, 8], "applied"), ([18, 18, 12], "rejected"), ([19, 19, 10], "proposed")):
            s.add(db.ProposalRow(job=job, status=status, source="policy", strategy="profiled",
                                 base_version=0, shares=shares, current_shares=[16, 16, 16],
                                 explanation={"gain": 0.3, "ranks": [{"rank": 0}]}))
        db.record_audit(s, actor=Actor("bob", "operator", None, "10.1.2.3"), action="proposal.approve",
                        job=job, params={"proposal_id": 1, "shares": [20, 20, 8]}, reason="faster")
        db.record_audit(s, actor="controller", action="job.create", job=job, params={})
        s.commit()
    with sm() as s:
        st = db.get_settings(s, job)
        assert (st.mode, st.policy) == ("auto", {"strategy": "static", "min_gain": 0.1})
        assert db.latest_placement(s, job).version == 1  # version 2 failed
        assert db.latest_placement(s, job, include_failed=True).version == 2
        pub = db.get_placement(s, job, 1).public()
        assert pub["acks"] == {0: 7, 1: 7, 2: 7}
        assert pub["effect"] == {"step_ms_before": 80.0, "step_ms_after": 40.0, "predicted_step_ms": None,
                                 "measured_gain": 0.5, "rolled_back": False, "prediction": None}
        assert [p.version for p in db.list_placements(s, job)] == [2, 1, 0]
        props = db.list_proposals(s, job)
        assert [p.status for p in props] == ["proposed", "rejected", "applied"]
        assert props[2].public()["explanation"] == {"gain": 0.3, "ranks": [{"rank": 0}]}
        assert [p.shares for p in db.list_proposals(s, job, status="rejected")] == [[18, 18, 12]]
        assert db.get_proposal(s, "other-job", props[0].id) is None
        counts = db.proposal_counts(s, job)
        assert counts == {"proposed": 1, "approved": 0, "applied": 1, "rejected": 1,
                          "superseded": 0, "failed": 0, "expired": 0}
        audit = [a.public() for a in db.list_audit(s, job)]
        assert [(a["actor"], a["role"], a["action"]) for a in audit] == [
            ("controller", "system", "job.create"), ("bob", "operator", "proposal.approve")]
        assert audit[1]["address"] == "10.1.2.3" and audit[1]["reason"] == "faster"
        assert audit[1]["params"] == {"proposal_id": 1, "shares": [20, 20, 8]}


def test_a_version_is_unique_per_job(sessions):
    sm, job = sessions
    with sm() as s:
        s.add(db.PlacementRow(job=job, version=0, shares=[1, 1], source="initial", acks={}))
        s.commit()
        s.add(db.PlacementRow(job=job, version=0, shares=[2, 0], source="manual", acks={}))
        with pytest.raises(IntegrityError):
            s.commit()


def test_controller_lifecycle_on_this_database(sessions):
    """The controller's own queries (versions, pending proposals, acks) on each database."""
    import asyncio

    from backend.control.controller import Controller
    from backend.control.policy_runs import PolicyRunner
    from backend.live.state import LiveState
    from backend.peers.connections import HookConnections
    from backend.settings import Settings
    from backend.storage.gateway import SqlGateway
    from rebalancer_wire.protocol import Ack, Hello

    sm, job = sessions
    sql = SqlGateway(sm)

    def controller() -> Controller:
        return Controller(settings=Settings(), sql=sql, live=LiveState(), connections=HookConnections(),
                          notify=lambda job: None, policy=PolicyRunner(process=False))

    ctl = controller()
    op = Actor("olga", "operator", None, "127.0.0.1")

    async def story() -> None:
        for r in range(2):
            assert (await ctl.on_hello(Hello(job=job, rank=r, world_size=2, global_batch_size=10))).version == 0
        p = await ctl.submit_manual(job, [7, 3], actor=op, reason="r1 slow", apply=True)
        for r in range(2):
            await ctl.on_ack(Ack(job=job, rank=r, version=1, batch_index=9))
        assert (await ctl.proposals(job, "applied"))[0]["id"] == p["id"]
        restarted = controller()
        assert (await restarted.on_hello(Hello(job=job, rank=0, world_size=2, global_batch_size=10))).shares == [7, 3]
        assert (await restarted.placements(job))[0]["acks"] == {0: 9, 1: 9}
        assert restarted.proposal_counts(job)["applied"] == 1
        assert [a["action"] for a in await restarted.audit(job)] == ["proposal.approve", "proposal.create", "job.create"]

    asyncio.run(story())
    sql.close()

"""Lease fencing in process (issue 38): two controllers on one SQLite file stand for two
backends on one database. Each load of a job installs a new epoch in ``job_owners``; a control
write of the controller whose epoch was overtaken is refused in its own transaction (409) and
leaves nothing behind, and the controller that holds the fence writes on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backend.auth.tokens import Actor
from backend.control.errors import FencedError
from backend.control.policy_runs import PolicyRunner
from backend.parts import build_parts
from backend.settings import Settings
from backend.storage import control as db
from backend.storage.owners import epoch_of
from rebalancer_wire.protocol import Hello
from tests.helpers.fakes import PlacementSocket, restarted

OPERATOR = Actor(name="alice", role="operator", address="10.0.0.7")
JOB = "fenced"


@pytest.fixture
def svc(tmp_path: Path):
    parts = build_parts(Settings(db=f"sqlite:///{tmp_path / 'r.db'}"), policy=PolicyRunner(process=False))
    yield parts
    parts.sql.close()
    parts.engine.dispose()


def _placements(svc) -> list[list[int]]:
    return svc.sql.call(lambda s: [list(p.shares) for p in sorted(db.list_placements(s, JOB), key=lambda p: p.version)])


def test_a_write_under_an_overtaken_epoch_is_refused_and_leaves_nothing(svc) -> None:
    async def run() -> None:
        a = svc.controller
        sock = PlacementSocket()
        svc.connections.add(JOB, 0, sock)
        hello = Hello(job=JOB, rank=0, world_size=2, global_batch_size=32, device_name="cpu")
        svc.live.register(hello)
        await a.on_hello(hello)
        assert svc.sql.call(lambda s: epoch_of(s, JOB)) == (1, "local")
        b = restarted(svc)  # a second backend on the same database
        sent = len(sock.sent)
        actions = (lambda: a.submit_manual(JOB, [20, 12], actor=OPERATOR, apply=True),
                   lambda: a.set_mode(JOB, "auto", actor=OPERATOR),
                   lambda: a.set_overrides(JOB, {"pins": {"0": 8}}, actor=OPERATOR),
                   lambda: a.set_policy(JOB, {"min_gain": 0.2}, actor=OPERATOR))
        for i, action in enumerate(actions):
            await a.overrides(JOB)  # A holds the job (loaded: epoch 1, then again after each refusal)
            mine = 1 + 2 * i
            assert svc.sql.call(lambda s: epoch_of(s, JOB)) == (mine, "local")
            b.forget(JOB)
            await b.overrides(JOB)  # B takes it: the next epoch
            with pytest.raises(FencedError) as refused:
                await action()
            assert refused.value.status_code == 409
            assert refused.value.detail == (
                f"Replica local no longer owns job '{JOB}' (lease epoch {mine} < {mine + 1}); nothing was "
                "applied. Retry: the request will be forwarded to the owner.")
        assert _placements(svc) == [[16, 16]] and len(sock.sent) == sent  # nothing stored, nothing sent
        assert [r.action for r in svc.sql.call(lambda s: db.list_audit(s, JOB))] == ["job.create"]
        placed = await b.submit_manual(JOB, [20, 12], actor=OPERATOR, apply=True)
        assert placed["status"] == "approved"
        assert _placements(svc) == [[16, 16], [20, 12]]
        # The fenced controller dropped its state: loaded again, it takes a newer epoch and
        # reads what the store has in force (with one replica the last loader holds the fence).
        await a.overrides(JOB)
        assert a.job_control(JOB)["placement"] == {"version": 1, "shares": [20, 12]}
        [mine, _] = svc.sql.call(lambda s: epoch_of(s, JOB))
        assert mine > 6
        b.forget(JOB)
        await b.overrides(JOB)
        with pytest.raises(FencedError, match=rf"\(lease epoch {mine} < {mine + 1}\)"):
            await a.rollback(JOB, actor=OPERATOR)
        assert _placements(svc) == [[16, 16], [20, 12]]
        assert (await b.rollback(JOB, actor=OPERATOR))["shares"] == [16, 16]

    asyncio.run(run())

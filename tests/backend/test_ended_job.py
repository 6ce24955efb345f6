"""No placement for a job whose ranks have all said goodbye (issue 26, item 11).

Under load, auto mode once applied a placement after the ranks of a finished job said
goodbye: no rank received it, and the job's report, stored at the goodbye, did not list it
while the placements history did. The rule: once every rank has said goodbye, nothing is
applied, proposed or rolled back; the controller says why and a REST approve answers 409.
The interleavings are forced here (the goodbyes land inside the policy's decision, and
between the proposal being stored and auto mode applying it), not waited for.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from backend.auth.tokens import Actor
from backend.control.controller import ConflictError
from backend.control.policy_runs import PolicyRunner
from backend.main import create_app
from backend.parts import build_parts
from backend.settings import Settings
from rebalancer_wire.protocol import Hello, Placement, decode, encode
from tests.backend.test_controller import JOB, feed, join
from tests.helpers.fakes import FrozenClock, policy_tick
from tests.helpers.waiting import wait_until

OPERATOR = Actor(name="alice", role="operator", address="10.0.0.7")
ENDED = f"Job '{JOB}' has ended (every rank said goodbye); a placement would never take effect."


@pytest.fixture
def env(tmp_path: Path):
    clock, wall = FrozenClock(1000.0), FrozenClock(1000.0)
    svc = build_parts(Settings(db=f"sqlite:///{tmp_path / 'r.db'}", proposal_ttl_s=60.0,
                               min_steps=6, policy_min_interval_s=0.0),
                      policy=PolicyRunner(process=False), clock=clock, wall=wall)
    svc.clock = clock  # the policy ticker's clock, for tests to move on
    yield svc, svc.controller
    svc.sql.close()
    svc.engine.dispose()


def goodbye_all(svc: Any, world: int = 3) -> None:
    """What the websocket route does when each rank closes normally."""
    for r in range(world):
        svc.live.set_connected(JOB, r, False, lost=False)
        svc.live.said_goodbye(JOB, r)


def test_approve_after_every_rank_said_goodbye_is_refused(env):
    svc, ctl = env
    socks = asyncio.run(join(svc, ctl))
    prop = asyncio.run(ctl.submit_manual(JOB, [20, 20, 8], actor=OPERATOR))
    goodbye_all(svc)
    assert svc.live.ended(JOB)
    with pytest.raises(ConflictError) as e:
        asyncio.run(ctl.approve(JOB, prop["id"], actor=OPERATOR))
    assert e.value.detail == ENDED
    with pytest.raises(ConflictError) as e:
        asyncio.run(ctl.submit_manual(JOB, [18, 18, 12], actor=OPERATOR, apply=True))
    assert e.value.detail == ENDED
    assert [p["version"] for p in asyncio.run(ctl.placements(JOB))] == [0]
    assert all(s.sent == [] for s in socks)
    assert asyncio.run(ctl.proposal(JOB, prop["id"]))["status"] == "proposed"


def test_a_new_hello_makes_an_ended_job_take_placements_again(env):
    svc, ctl = env
    asyncio.run(join(svc, ctl))
    goodbye_all(svc)
    socks = asyncio.run(join(svc, ctl))  # the job runs again (same shape)
    assert not svc.live.ended(JOB)
    out = asyncio.run(ctl.submit_manual(JOB, [20, 20, 8], actor=OPERATOR, apply=True))
    assert out["status"] == "approved"
    assert [m.version for m in socks[0].sent] == [1]


async def _auto_job(svc: Any, ctl: Any) -> list[Any]:
    socks = await join(svc, ctl)
    await ctl.set_mode(JOB, "auto", actor=OPERATOR)
    feed(svc, [16, 16, 16], 0, range(0, 12), step_ms=70.0)  # rank 2 computes 4x slower
    return socks


def test_ranks_leaving_while_the_policy_decides_get_no_placement(env):
    svc, ctl = env
    decide = ctl.policy.runner.decide_timed  # what the controller calls: the decision and its cost

    async def decide_then_everyone_leaves(*args: Any, **kw: Any) -> Any:
        got = await decide(*args, **kw)
        goodbye_all(svc)  # the goodbyes land while the policy is thinking
        return got

    ctl.policy.runner.decide_timed = decide_then_everyone_leaves

    async def scenario() -> list[Any]:
        socks = await _auto_job(svc, ctl)
        assert await policy_tick(ctl, JOB) == 1
        return socks

    socks = asyncio.run(scenario())
    assert [p["version"] for p in asyncio.run(ctl.placements(JOB))] == [0]
    assert asyncio.run(ctl.proposals(JOB)) == []
    assert all(s.sent == [] for s in socks)


def test_ranks_leaving_between_the_proposal_and_auto_apply_get_no_placement(env):
    svc, ctl = env
    publish = ctl.store.publish

    def publish_then_everyone_leaves(st: Any) -> None:
        publish(st)
        if st.status == "proposal_pending" and not svc.live.ended(JOB):
            goodbye_all(svc)  # the proposal is stored; auto mode is about to apply it

    async def scenario() -> list[Any]:
        socks = await _auto_job(svc, ctl)
        ctl.store.publish = publish_then_everyone_leaves
        assert await policy_tick(ctl, JOB) == 1
        return socks

    socks = asyncio.run(scenario())
    assert [p["version"] for p in asyncio.run(ctl.placements(JOB))] == [0]
    (prop,) = asyncio.run(ctl.proposals(JOB))
    assert prop["status"] == "proposed" and prop["placement_version"] is None
    assert all(s.sent == [] for s in socks)
    # Later runs leave the ended job alone.
    feed(svc, [16, 16, 16], 0, range(12, 20), step_ms=70.0)
    svc.clock.t += 60.0
    assert asyncio.run(policy_tick(ctl, JOB)) == 1
    assert [p["version"] for p in asyncio.run(ctl.placements(JOB))] == [0]


def test_rest_approve_of_a_finished_job_answers_409(tmp_path: Path):
    admin = "admin-secret-0123456789"
    app = create_app(Settings(db=f"sqlite:///{tmp_path / 'r.db'}", admin_token=admin))
    auth = {"Authorization": f"Bearer {admin}"}
    base = f"/api/v1/jobs/{JOB}"
    with TestClient(app) as client:
        with client.websocket_connect(f"/ws/hook?token={admin}") as ws:
            ws.send_text(encode(Hello(job=JOB, rank=0, world_size=1, global_batch_size=16)))
            assert isinstance(decode(ws.receive_text()), Placement)
            r = client.post(f"{base}/proposals", json={"shares": [16]}, headers=auth)
            assert r.status_code == 201, r.text
            pid = r.json()["id"]
        # The socket closed normally: the hook's goodbye.
        parts = app.state.parts
        wait_until(lambda: parts.live.ended(JOB), "the goodbye handled", timeout=10.0, interval=0.01)
        r = client.post(f"{base}/proposals/{pid}/approve", json={"reason": "go"}, headers=auth)
        assert (r.status_code, r.json()) == (409, {"detail": ENDED})
        assert [p["version"] for p in client.get(f"{base}/placements", headers=auth).json()["data"]] == [0]


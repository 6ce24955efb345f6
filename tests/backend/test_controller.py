"""The control loop in process: real SQLite file, real LiveState, the controller's own calls.

The only stand-in is ``PlacementSocket``, which takes the place of a hook's websocket so the test
can read exactly what the controller sent.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backend.auth.tokens import Actor
from backend.control.controller import ConflictError, InvalidError, NotFoundError
from backend.control.policy_runs import PolicyRunner
from backend.parts import build_parts
from backend.settings import Settings
from rebalancer_wire.protocol import Ack, Hello, Metrics, Reject, StepRecord
from tests.helpers.fakes import FrozenClock, PlacementSocket, policy_tick, restarted

OPERATOR = Actor(name="alice", role="operator", address="10.0.0.7")
JOB = "job-a"


@pytest.fixture
def env(tmp_path: Path):
    clock, wall = FrozenClock(1000.0), FrozenClock(1000.0)
    svc = build_parts(Settings(db=f"sqlite:///{tmp_path / 'r.db'}", proposal_ttl_s=60.0),
                      policy=PolicyRunner(process=False), clock=clock, wall=wall)
    ctl = svc.controller
    yield svc, ctl, clock, wall
    svc.sql.close()
    svc.engine.dispose()


def run(coro):
    return asyncio.run(coro)


def hello(rank: int, world: int = 3, b: int = 48, job: str = JOB) -> Hello:
    return Hello(job=job, rank=rank, world_size=world, global_batch_size=b, device_name="cpu")


async def join(svc, ctl, world: int = 3, b: int = 48) -> list[PlacementSocket]:
    socks = []
    for r in range(world):
        h = hello(r, world, b)
        svc.live.register(h)
        sock = PlacementSocket()
        svc.connections.add(JOB, r, sock)
        socks.append(sock)
        assert (await ctl.on_hello(h)).version >= 0
    return socks


def feed(svc, shares, version, batches, step_ms, per_sample_ms=(1.0, 1.0, 4.0)):
    for r, share in enumerate(shares):
        steps = [StepRecord(batch_index=k, local_batch_size=share, placement_version=version,
                            data_wait_ms=0.1, compute_ms=per_sample_ms[r] * share,
                            sync_wait_ms=1.0, optimizer_ms=0.5, step_ms=step_ms, t=1000.0 + k)
                 for k in batches]
        svc.live.add_metrics(Metrics(job=JOB, rank=r, steps=steps))


def test_new_job_gets_uniform_version_0_that_survives_a_restart(env):
    svc, ctl, _, _ = env
    p = run(ctl.on_hello(hello(0, 3, 32)))
    assert (p.version, p.shares, p.global_batch_size) == (0, [11, 11, 10], 32)
    fresh = restarted(svc)  # a restarted backend: nothing in memory
    assert run(fresh.on_hello(hello(2, 3, 32))).shares == [11, 11, 10]
    state = fresh.job_control(JOB)
    assert state["mode"] == "approve" and state["placement"] == {"version": 0, "shares": [11, 11, 10]}
    assert [a["action"] for a in run(fresh.audit(JOB))] == ["job.create"]


def test_reshaped_job_gets_a_new_uniform_version(env):
    svc, ctl, _, _ = env
    run(ctl.on_hello(hello(0, 3, 48)))
    p = run(ctl.on_hello(hello(0, 4, 48)))
    assert (p.version, p.shares) == (1, [12, 12, 12, 12])


def test_unknown_job_is_404(env):
    _, ctl, _, _ = env
    with pytest.raises(NotFoundError, match=r"^Job 'nope' not found\.$"):
        run(ctl.proposals("nope"))
    assert ctl.job_control("nope") == {}


def test_manual_proposal_validation_names_the_problem(env):
    svc, ctl, _, _ = env
    run(join(svc, ctl))
    with pytest.raises(InvalidError) as e:
        run(ctl.submit_manual(JOB, [20, 20, 20], actor=OPERATOR))
    assert e.value.detail == "Invalid placement: shares sum to 60 but the global batch size is 48."
    with pytest.raises(InvalidError) as e:
        run(ctl.submit_manual(JOB, [24, 24], actor=OPERATOR))
    assert e.value.detail == "Invalid placement: shares has 2 entries but the job has world_size 3."
    with pytest.raises(InvalidError) as e:
        run(ctl.submit_manual(JOB, [24, "x", 24], actor=OPERATOR))
    assert e.value.detail == "Invalid placement: shares[1] must be an integer, got 'x'."


def test_approve_sends_exactly_the_reviewed_shares_and_acks_apply_it(env):
    svc, ctl, _, _ = env
    socks = run(join(svc, ctl))
    prop = run(ctl.submit_manual(JOB, [20, 20, 8], actor=OPERATOR, reason="rank 2 is slow"))
    assert prop["status"] == "proposed" and prop["base_version"] == 0
    assert ctl.job_control(JOB)["status"] == "proposal_pending"
    assert all(s.sent == [] for s in socks)  # nothing leaves before approval
    out = run(ctl.approve(JOB, prop["id"], actor=OPERATOR, reason="looks right"))
    assert out["status"] == "approved" and out["placement_version"] == 1
    for s in socks:
        assert [(m.version, m.shares, m.proposal_id) for m in s.sent] == [(1, [20, 20, 8], prop["id"])]
    for r in range(3):
        run(ctl.on_ack(Ack(job=JOB, rank=r, version=1, batch_index=40)))
    (pl, v0) = run(ctl.placements(JOB))
    assert pl["acks"] == {0: 40, 1: 40, 2: 40} and pl["effective_batch_index"] == 40
    assert pl["previous_shares"] == v0["shares"] == [16, 16, 16]
    assert run(ctl.proposals(JOB, "applied"))[0]["id"] == prop["id"]
    audit = run(ctl.audit(JOB))[0]
    assert (audit["action"], audit["actor"], audit["role"], audit["address"], audit["reason"]) == (
        "proposal.approve", "alice", "operator", "10.0.0.7", "looks right")
    assert audit["params"]["shares"] == [20, 20, 8]


def test_rejected_or_expired_proposals_cannot_be_approved(env):
    svc, ctl, _, wall = env
    run(join(svc, ctl))
    a = run(ctl.submit_manual(JOB, [20, 20, 8], actor=OPERATOR))
    run(ctl.reject(JOB, a["id"], actor=OPERATOR, reason="not now"))
    with pytest.raises(ConflictError) as e:
        run(ctl.approve(JOB, a["id"], actor=OPERATOR))
    assert e.value.detail == f"Proposal {a['id']} is rejected; only a proposed one can be approved."
    b = run(ctl.submit_manual(JOB, [18, 18, 12], actor=OPERATOR))
    wall.t += 61  # TTL is 60 s
    assert run(ctl.expire_proposals()) == 1
    assert run(ctl.proposals(JOB, "expired"))[0]["id"] == b["id"]
    with pytest.raises(NotFoundError):
        run(ctl.approve(JOB, 999, actor=OPERATOR))


def test_proposal_against_an_older_version_answers_409_with_refresh(env):
    svc, ctl, _, _ = env
    run(join(svc, ctl))
    first = run(ctl.submit_manual(JOB, [20, 20, 8], actor=OPERATOR, apply=True))
    stale = run(ctl.submit_manual(JOB, [18, 18, 12], actor=OPERATOR))
    run(ctl.rollback(JOB, actor=OPERATOR, reason="back out"))  # version 2 now in force
    assert first["placement_version"] == 1
    with pytest.raises(ConflictError) as e:
        run(ctl.approve(JOB, stale["id"], actor=OPERATOR))
    assert e.value.detail == (f"Proposal {stale['id']} was computed against placement version 1 "
                              "but version 2 is in force; refresh.")
    assert run(ctl.proposals(JOB, "expired"))[0]["id"] == stale["id"]


def test_rollback_restores_the_exact_previous_shares(env):
    svc, ctl, _, _ = env
    socks = run(join(svc, ctl, b=50))
    with pytest.raises(ConflictError, match="no previous placement"):
        run(ctl.rollback(JOB, actor=OPERATOR))
    run(ctl.submit_manual(JOB, [30, 15, 5], actor=OPERATOR, apply=True))
    out = run(ctl.rollback(JOB, actor=OPERATOR, reason="worse"))
    assert (out["version"], out["shares"], out["source"]) == (2, [17, 17, 16], "rollback")
    assert [m.shares for m in socks[0].sent] == [[30, 15, 5], [17, 17, 16]]
    assert run(ctl.placements(JOB))[1]["effect"]["rolled_back"] is True
    assert run(ctl.on_hello(hello(1, 3, 50))).version == 2


def test_observe_mode_never_sends(env):
    svc, ctl, _, _ = env
    socks = run(join(svc, ctl))
    run(ctl.set_mode(JOB, "observe", actor=OPERATOR, reason="watch first"))
    p = run(ctl.submit_manual(JOB, [20, 20, 8], actor=OPERATOR))
    with pytest.raises(ConflictError, match="observe mode"):
        run(ctl.approve(JOB, p["id"], actor=OPERATOR))
    assert all(s.sent == [] for s in socks)
    with pytest.raises(InvalidError, match="observe, approve, auto"):
        run(ctl.set_mode(JOB, "yolo", actor=OPERATOR))
    mode_rec = next(a for a in run(ctl.audit(JOB)) if a["action"] == "job.mode")
    assert mode_rec["params"] == {"mode": "observe", "previous": "approve"}
    assert mode_rec["reason"] == "watch first"


def test_hook_reject_fails_the_proposal_with_its_reason(env):
    svc, ctl, _, _ = env
    run(join(svc, ctl))
    p = run(ctl.submit_manual(JOB, [20, 20, 8], actor=OPERATOR, apply=True))
    run(ctl.on_reject(Reject(job=JOB, rank=0, version=1, reason="shares[2] exceeds the memory cap")))
    failed = run(ctl.proposals(JOB, "failed"))[0]
    assert failed["id"] == p["id"]
    assert failed["error"] == "rank 0 rejected placement version 1: shares[2] exceeds the memory cap"
    assert run(ctl.placements(JOB))[0]["failed"] is True
    # The job keeps the placement it had; a reconnecting rank gets that one.
    assert run(ctl.on_hello(hello(0))).shares == [16, 16, 16]
    assert ctl.job_control(JOB)["placement"]["version"] == 0


def test_measured_effect_after_applying(env):
    svc, ctl, clock, _ = env
    run(join(svc, ctl))
    feed(svc, [16, 16, 16], 0, range(0, 30), step_ms=80.0)
    p = run(ctl.submit_manual(JOB, [20, 20, 8], actor=OPERATOR, apply=True))
    for r in range(3):
        run(ctl.on_ack(Ack(job=JOB, rank=r, version=1, batch_index=30)))
    assert run(ctl.placements(JOB))[0]["effect"]["step_ms_before"] == pytest.approx(80.0)
    feed(svc, [20, 20, 8], 1, range(30, 60), step_ms=40.0)
    clock.t += 1
    run(policy_tick(ctl, JOB))
    effect = run(ctl.placements(JOB))[0]["effect"]
    assert effect["step_ms_after"] == pytest.approx(40.0)
    assert effect["measured_gain"] == pytest.approx(0.5)
    assert effect["predicted_step_ms"] == p["predicted_step_ms_after"] == pytest.approx(32.0)
    assert ctl.job_control(JOB)["last_effect"]["measured_gain"] == pytest.approx(0.5)


def test_proposal_counts_by_status(env):
    svc, ctl, _, _ = env
    run(join(svc, ctl))
    a = run(ctl.submit_manual(JOB, [20, 20, 8], actor=OPERATOR))
    run(ctl.reject(JOB, a["id"], actor=OPERATOR))
    run(ctl.submit_manual(JOB, [18, 18, 12], actor=OPERATOR))
    counts = ctl.proposal_counts(JOB)
    assert counts["rejected"] == 1 and counts["proposed"] == 1 and counts["applied"] == 0


def test_a_job_running_a_version_the_backend_never_saw_gets_a_newer_one(env):
    svc, ctl, _, _ = env
    h = Hello(job="orphan", rank=0, world_size=2, global_batch_size=8, placement_version=5)
    p = run(ctl.on_hello(h))
    assert (p.version, p.shares) == (6, [4, 4])


def test_lost_acks_are_recovered_from_the_steps(env):
    svc, ctl, clock, _ = env
    run(join(svc, ctl))
    feed(svc, [16, 16, 16], 0, range(0, 20), step_ms=80.0)
    run(ctl.submit_manual(JOB, [20, 20, 8], actor=OPERATOR, apply=True))
    run(ctl.on_ack(Ack(job=JOB, rank=1, version=1, batch_index=20)))  # the others' acks got lost
    feed(svc, [20, 20, 8], 1, range(20, 30), step_ms=40.0)
    clock.t += 1
    run(policy_tick(ctl, JOB))
    row = run(ctl.placements(JOB))[0]
    assert row["acks"] == {0: 20, 1: 20, 2: 20} and row["effective_batch_index"] == 20
    assert row["applied_at"] is not None and run(ctl.proposals(JOB))[0]["status"] == "applied"


def test_policy_runs_are_spaced_by_their_own_cost(env):
    svc, ctl, clock, _ = env
    run(join(svc, ctl))
    feed(svc, [16, 16, 16], 0, range(0, 20), step_ms=80.0)
    run(policy_tick(ctl, JOB))
    st = ctl.store.get(JOB)
    first = st.last_run
    st.think_s = 1.0  # as if one run took a second, as at thousands of ranks
    clock.t += 2.0  # past the 0.5 s floor, not past five times the run's cost
    run(policy_tick(ctl, JOB))
    assert st.last_run == first
    clock.t += 3.5
    run(policy_tick(ctl, JOB))
    assert st.last_run == clock.t


def test_a_torchelastic_restart_is_audited_once_when_its_ranks_say_hello_together(env):
    """All ranks of a restarted attempt say hello at about the same time; the restart is one
    event, audited once (CI saw two audit rows when both hellos interleaved)."""
    svc, ctl, _, _ = env

    async def go() -> None:
        await join(svc, ctl, world=2, b=32)
        again = [Hello(job=JOB, rank=r, world_size=2, global_batch_size=32, device_name="cpu",
                       restart_count=1) for r in range(2)]
        await asyncio.gather(*(ctl.on_hello(h) for h in again))

    run(go())
    restarts = [a for a in run(ctl.audit(JOB)) if a["action"] == "job.restart"]
    assert [a["params"]["restart_count"] for a in restarts] == [1], restarts


def test_an_action_right_after_the_first_hello_waits_for_the_job_instead_of_404(env):
    # The job is in live state (GET /jobs lists it) from the moment a rank's hello arrives;
    # its control state is made once the hello is stored. A PUT .../mode in between was
    # answered 404 (bench.reaction lost 2 of 5 runs to it): now it waits for the job.
    svc, ctl, _, _ = env

    async def scenario():
        h = hello(0)
        svc.live.register(h)
        ctl.expect(h.job)  # what ingest does beside live.register
        early = asyncio.create_task(ctl.set_mode(JOB, "auto", actor=OPERATOR))
        await asyncio.sleep(0.05)  # the hello's SQL write is still under way
        assert not early.done()
        await ctl.on_hello(h)
        return await early

    assert run(scenario())["mode"] == "auto"


def test_an_action_on_a_job_whose_hello_never_lands_still_gets_404(env):
    _, ctl, _, _ = env

    async def scenario():
        ctl.expect("ghost")  # its hello could not be stored (say, the database is away)
        ctl.store.arrival_wait_s = 0.2
        with pytest.raises(NotFoundError):  # (a mode for a job not seen is a preset: tests/backend/test_mode_preset.py)
            await ctl.rollback("ghost", actor=OPERATOR)

    run(scenario())

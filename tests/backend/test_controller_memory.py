"""The controller and memory in process: manual placements over a memory cap, the oom
report, and the proposal new overrides make (real SQLite, real LiveState)."""

from __future__ import annotations

from backend.control.controller import InvalidError
from rebalancer_wire.protocol import Hello, Metrics, Oom, StepRecord
from tests.backend.test_controller import JOB, OPERATOR, env, feed, join, run  # noqa: F401

GB = 10**9


def memory(svc, shares, version, batches, *, total=(4 * GB, 80 * GB, 80 * GB)):
    """Peak-memory readings: 1 GB + 0.1 GB a sample on every rank, cards of ``total``."""
    for r, share in enumerate(shares):
        steps = [StepRecord(batch_index=k, local_batch_size=share, placement_version=version,
                            data_wait_ms=0.1, compute_ms=1.0 * share, sync_wait_ms=1.0,
                            optimizer_ms=0.5, step_ms=50.0, t=1000.0 + k,
                            mem_peak_bytes=GB + share * GB // 10, mem_total_bytes=total[r])
                 for k in batches]
        svc.live.add_metrics(Metrics(job=JOB, rank=r, steps=steps))


def join_measured(svc, ctl):
    for r in range(3):
        svc.live.register(Hello(job=JOB, rank=r, world_size=3, global_batch_size=48,
                                device_name="gpu", memory_source="cuda"))
    return run(join(svc, ctl))


def test_manual_placement_over_a_memory_cap_is_refused_unless_forced(env):  # noqa: F811
    svc, ctl, _, _ = env
    join_measured(svc, ctl)
    memory(svc, [16, 16, 16], 0, range(0, 4))
    # Rank 0: proportional fit at 16 = 0.1625 GB a sample, limit 3.6 GB: cap 22.
    try:
        run(ctl.submit_manual(JOB, [30, 9, 9], actor=OPERATOR))
    except InvalidError as exc:
        assert exc.detail == (
            "Placement breaks memory caps: rank 0 would peak at 4.5 GiB with 30 samples, above its "
            "limit of 3.4 GiB (90% of 3.7 GiB); its memory cap is 22 samples. Send force=true to "
            "submit it anyway.")
    else:
        raise AssertionError("a placement over a memory cap was accepted")
    ok = run(ctl.submit_manual(JOB, [22, 13, 13], actor=OPERATOR))
    mem0 = ok["explanation"]["memory"][0]
    assert (mem0["mem_cap"], mem0["mem_peak_after_bytes"]) == (22, 22 * 0.1625 * GB)
    forced = run(ctl.submit_manual(JOB, [30, 9, 9], actor=OPERATOR, force=True, reason="I know"))
    assert forced["explanation"]["memory_forced"][0].startswith("rank 0 would peak at 4.5 GiB")
    audit = run(ctl.audit(JOB))
    force = [a for a in audit if a["action"] == "placement.memory_force"]
    assert force and force[0]["actor"] == "alice" and force[0]["reason"] == "I know"


def test_oom_marks_the_placement_unsafe_caps_the_rank_and_rolls_back(env):  # noqa: F811
    svc, ctl, _, _ = env
    socks = join_measured(svc, ctl)
    run(ctl.submit_manual(JOB, [20, 14, 14], actor=OPERATOR, apply=True))
    assert socks[0].sent[-1].shares == [20, 14, 14]
    v1 = socks[0].sent[-1].version
    run(ctl.on_oom(Oom(job=JOB, rank=0, version=v1, batch_index=30, local_batch_size=20,
                       mem_peak_bytes=3 * GB, mem_total_bytes=4 * GB, message="CUDA out of memory")))
    back = socks[0].sent[-1]
    assert back.version == v1 + 1 and back.shares == [16, 16, 16]
    assert "rank 0 ran out of memory at 20 samples under placement version" in back.reason
    assert run(ctl.overrides(JOB))["caps"] == {0: 19}
    pl = {p["version"]: p for p in run(ctl.placements(JOB))}
    assert pl[v1]["failed"] and pl[v1]["error"].startswith("unsafe: rank 0 ran out of memory at 20")
    actions = [a["action"] for a in run(ctl.audit(JOB))]
    assert {"placement.oom", "job.overrides", "placement.oom_rollback"} <= set(actions)
    # The failing share is never offered again, by anyone short of lifting the cap.
    try:
        run(ctl.submit_manual(JOB, [20, 14, 14], actor=OPERATOR, force=True))
    except InvalidError as exc:
        assert "rank 0 is capped at 19 samples but gets 20" in exc.detail
    else:
        raise AssertionError("the failing share was accepted again")


def test_oom_under_the_first_placement_solves_under_the_new_cap(env):  # noqa: F811
    svc, ctl, _, _ = env
    socks = join_measured(svc, ctl)
    feed(svc, [16, 16, 16], 0, range(0, 12), 50.0)
    run(ctl.on_oom(Oom(job=JOB, rank=2, version=0, batch_index=3, local_batch_size=16)))
    back = socks[0].sent[-1]
    assert back.shares[2] <= 15 and sum(back.shares) == 48
    assert run(ctl.overrides(JOB))["caps"] == {2: 15}


def test_new_overrides_propose_a_split_within_the_memory_caps(env):  # noqa: F811
    svc, ctl, _, _ = env
    join_measured(svc, ctl)
    memory(svc, [16, 16, 16], 0, range(0, 4), total=(4 * GB, 80 * GB, 4 * GB))
    # Draining rank 1 leaves 48 samples to ranks 0 and 2, whose memory holds 22 each.
    try:
        run(ctl.set_overrides(JOB, {"drains": [1]}, actor=OPERATOR))
    except InvalidError as exc:
        assert exc.detail.startswith("The overrides admit no placement: caps sum to 44")
    else:
        raise AssertionError("overrides that push ranks past their memory were accepted")
    got = run(ctl.set_overrides(JOB, {"caps": {"1": 12}}, actor=OPERATOR))
    prop = [p for p in run(ctl.proposals(JOB)) if p["id"] == got["proposal_id"]][0]
    assert prop["shares"][1] <= 12 and prop["shares"][0] <= 22 and prop["shares"][2] <= 22

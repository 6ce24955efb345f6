"""The controller driven by the real policy: measured steps in a real LiveState, a frozen
clock, a SQLite file. ``PlacementSocket`` stands in for the hooks' websockets to record sends."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backend.auth.tokens import Actor
from backend.control.policy_runs import PolicyRunner, default_decide
from backend.parts import build_parts
from backend.settings import Settings
from rebalancer_wire.protocol import Ack, Hello, Metrics, StepRecord
from tests.helpers.fakes import FrozenClock, PlacementSocket, policy_tick
from tests.helpers.waiting import wait_until_async

JOB = "pol-job"
B = 48
OPERATOR = Actor(name="olga", role="operator", address="127.0.0.1")


class Job:
    """A job whose ranks take ``per_sample_ms[r] * share`` ms per step."""

    def __init__(self, tmp_path: Path, mode: str = "approve", decide=default_decide, **settings):
        self.clock = FrozenClock(5000.0)
        self.svc = build_parts(Settings(db=f"sqlite:///{tmp_path / 'r.db'}", default_mode=mode,
                                        min_steps=5, cooldown_steps=8, effect_window_steps=6,
                                        **settings),
                               policy=PolicyRunner(decide, process=False), clock=self.clock,
                               wall=self.clock)
        self.ctl = self.svc.controller
        self.socks: list[PlacementSocket] = []
        self.k = 0

    def hello(self, devices=("cpu", "cpu", "cpu")) -> None:
        for r, name in enumerate(devices):
            h = Hello(job=JOB, rank=r, world_size=len(devices), global_batch_size=B, device_name=name)
            self.svc.live.register(h)
            sock = PlacementSocket()
            self.svc.connections.add(JOB, r, sock)
            self.socks.append(sock)
            asyncio.run(self.ctl.on_hello(h))

    def steps(self, n: int, per_sample_ms=(1.0, 1.0, 4.0), shares=None, version=None) -> None:
        st = self.ctl.job_control(JOB)
        shares = shares or st["placement"]["shares"]
        version = st["placement"]["version"] if version is None else version
        step_ms = max(c * b for c, b in zip(per_sample_ms, shares, strict=True)) + 2.0
        for _ in range(n):
            for r, share in enumerate(shares):
                rec = StepRecord(batch_index=self.k, local_batch_size=share, placement_version=version,
                                 data_wait_ms=0.1, compute_ms=per_sample_ms[r] * share + 0.5,
                                 sync_wait_ms=step_ms - per_sample_ms[r] * share, optimizer_ms=0.3,
                                 step_ms=step_ms, t=1000.0 + self.k * step_ms / 1e3)
                self.svc.live.add_metrics(Metrics(job=JOB, rank=r, steps=[rec]))
            self.k += 1

    def start(self, n: int) -> None:
        """Every rank says hello, then ``n`` steps and a policy tick."""
        self.hello()
        self.steps(n)
        self.tick()

    def tick(self) -> None:
        self.clock.t += 1.0  # past the 0.5 s throttle
        asyncio.run(policy_tick(self.ctl, JOB))

    def ack_all(self, version: int) -> None:
        for r in range(len(self.socks)):
            asyncio.run(self.ctl.on_ack(Ack(job=JOB, rank=r, version=version, batch_index=self.k)))

    def close(self) -> None:
        self.svc.sql.close()
        self.svc.engine.dispose()


@pytest.fixture
def make(tmp_path):
    jobs: list[Job] = []

    def build(mode: str = "approve", **kw) -> Job:
        j = Job(tmp_path / str(len(jobs)), mode, **kw)
        jobs.append(j)
        return j

    yield build
    for j in jobs:
        j.close()


def test_warming_up_then_a_proposal_that_waits_for_an_operator(make):
    j = make("approve")
    j.start(2)
    assert j.ctl.job_control(JOB)["status"] == "warming_up"
    j.steps(10)
    j.tick()
    state = j.ctl.job_control(JOB)
    prop = state["pending_proposal"]
    assert state["status"] == "proposal_pending" and prop["source"] == "policy"
    assert prop["shares"][2] < 16 and sum(prop["shares"]) == B
    assert prop["predicted_step_ms_after"] < prop["predicted_step_ms_before"]
    assert prop["explanation"]["strategy"] == "profiled" and prop["reason"]
    assert all(s.sent == [] for s in j.socks)
    j.tick()  # same measurements: no duplicate
    assert len(asyncio.run(j.ctl.proposals(JOB))) == 1


def test_the_policy_is_throttled_per_job(make):
    j = make("approve")
    j.start(12)
    first = j.ctl.job_control(JOB)["pending_proposal"]
    j.steps(40, per_sample_ms=(1.0, 1.0, 1.0))  # rank 2 recovered
    asyncio.run(policy_tick(j.ctl, JOB))  # same instant: the policy does not run again
    assert j.ctl.job_control(JOB)["pending_proposal"]["id"] == first["id"]
    # An urgent frame (a step far off its rank's median) is not held by the 0.5 s pacing,
    # only by five times the policy's own cost.
    st = j.ctl.store.get(JOB)
    st.think_s = 0.01
    j.clock.t += 0.1
    j.ctl.on_metrics(JOB)
    assert asyncio.run(j.ctl.run_due()) == 0  # a plain frame: still paced
    j.ctl.on_metrics(JOB, urgent=True)
    assert asyncio.run(j.ctl.run_due()) == 1  # the urgent one runs the policy
    assert not st.urgent


def test_while_warming_up_every_frame_may_bring_the_first_proposal(make):
    j = make("approve")
    j.start(2)
    assert j.ctl.job_control(JOB)["status"] == "warming_up"
    j.ctl.store.get(JOB).think_s = 0.01  # runs stay spaced by five times their own cost
    j.steps(3)
    j.clock.t += 0.1  # well inside the 0.5 s that spaces runs once warmed up
    asyncio.run(policy_tick(j.ctl, JOB))
    assert j.ctl.job_control(JOB)["pending_proposal"] is not None


class _ColdRunner(PolicyRunner):
    """A runner whose first call waits half a second before deciding, as the first call in a
    fresh worker process waits for the process to start."""

    def __init__(self) -> None:
        super().__init__(process=False)
        self.cold = True

    async def decide_timed(self, obs, cfg, cons):
        if self.cold:
            self.cold = False
            await asyncio.sleep(0.5)
        return await super().decide_timed(obs, cfg, cons)


def test_a_slow_first_start_of_the_policy_worker_does_not_hold_the_warm_up_back(tmp_path):
    """Runs are spaced by five times their cost; the worker's start is no part of that cost.
    Counted in, it spaced a short-step job's warm-up runs by seconds (bench.tokens --real,
    B=16: the first proposal 40 steps late)."""
    j = Job(tmp_path, "approve")
    j.svc.controller.policy.runner = _ColdRunner()
    j.start(2)
    st = j.ctl.store.get(JOB)
    assert j.ctl.job_control(JOB)["status"] == "warming_up"
    assert st.think_s < 0.25, st.think_s
    j.steps(3)
    j.clock.t += 0.1
    asyncio.run(policy_tick(j.ctl, JOB))
    assert j.ctl.job_control(JOB)["pending_proposal"] is not None


def test_a_frame_that_lands_during_a_warm_up_run_makes_it_run_again(tmp_path):
    import threading

    thinking, go = threading.Event(), threading.Event()

    def slow_decide(*args):
        thinking.set()
        go.wait(10)
        return default_decide(*args)

    j = Job(tmp_path, "approve", decide=slow_decide)  # the policy is passed in, not patched
    j.hello()
    j.steps(2)

    async def scenario() -> None:
        j.clock.t += 1.0
        j.ctl.on_metrics(JOB)
        first = asyncio.create_task(j.ctl.run_due())
        await wait_until_async(thinking.is_set)
        j.steps(3)  # the frame that completes the warm-up, after the run read its steps
        j.ctl.on_metrics(JOB)
        assert await j.ctl.run_due() == 0  # a run is in flight: the job stays dirty
        go.set()
        assert await first == 1
        j.clock.t += 1.0
        assert await j.ctl.run_due() == 1  # the frame that landed during the run

    asyncio.run(scenario())
    j.close()
    assert j.ctl.job_control(JOB)["pending_proposal"] is not None


def test_a_rejected_split_is_not_proposed_again(make):
    j = make("approve")
    j.start(12)
    pid = j.ctl.job_control(JOB)["pending_proposal_id"]
    asyncio.run(j.ctl.reject(JOB, pid, actor=OPERATOR, reason="not during eval"))
    j.steps(5)
    j.tick()
    state = j.ctl.job_control(JOB)
    assert state["pending_proposal"] is None and state["status"] == "imbalanced"
    assert f"proposal {pid}" in state["status_detail"]


def test_observe_mode_computes_but_never_sends(make):
    j = make("observe")
    j.start(12)
    assert j.ctl.job_control(JOB)["pending_proposal"]["status"] == "proposed"
    assert all(s.sent == [] for s in j.socks)


def test_auto_mode_applies_under_the_move_cap_then_waits_out_the_cooldown(make):
    j = make("auto", auto_max_move_fraction=0.125)  # at most 6 samples a rank per change
    j.hello()
    j.steps(12, per_sample_ms=(1.0, 1.0, 8.0))
    j.tick()
    sent = [m.shares for m in j.socks[0].sent]
    assert len(sent) == 1 and sent[0][2] == 16 - 6  # the guardrail cut a bigger move
    assert all(abs(a - b) <= 6 for a, b in zip(sent[0], [16, 16, 16], strict=True))
    prop = asyncio.run(j.ctl.proposals(JOB))[0]
    assert (prop["status"], prop["decided_by"]) == ("approved", "auto")
    j.ack_all(1)
    assert asyncio.run(j.ctl.proposals(JOB))[0]["status"] == "applied"
    j.steps(4, per_sample_ms=(1.0, 1.0, 8.0))
    j.tick()
    assert len(j.socks[0].sent) == 1  # cooldown: 8 steps after the change
    assert j.ctl.job_control(JOB)["status_detail"].startswith("cooldown")
    j.steps(10, per_sample_ms=(1.0, 1.0, 8.0))
    j.tick()
    assert len(j.socks[0].sent) == 2 and j.socks[0].sent[1].shares[2] < sent[0][2]
    audit = [a for a in asyncio.run(j.ctl.audit(JOB)) if a["action"] == "proposal.auto_apply"]
    assert len(audit) == 2 and audit[0]["actor"] == "auto"


def _applied_then_rolled_back(j):
    """An auto change after which every step is slower than before (say the new shapes
    recompile): the change and the rollback the controller sends."""
    j.start(12)
    new = j.socks[0].sent[-1]
    j.ack_all(new.version)
    j.steps(10, shares=new.shares, version=new.version, per_sample_ms=(6.0, 6.0, 6.0))
    j.tick()
    return new, j.socks[0].sent[-1]


def test_auto_rollback_when_the_measured_step_time_gets_worse(make):
    j = make("auto", rollback_threshold=0.05)
    new, last = _applied_then_rolled_back(j)
    assert last.version == new.version + 1 and last.shares == [16, 16, 16]
    rows = asyncio.run(j.ctl.placements(JOB))
    assert rows[0]["source"] == "rollback" and rows[1]["effect"]["rolled_back"] is True
    assert rows[1]["effect"]["step_ms_after"] > rows[1]["effect"]["step_ms_before"]
    assert any(a["action"] == "placement.auto_rollback" and a["actor"] == "controller"
               for a in asyncio.run(j.ctl.audit(JOB)))
    assert j.ctl.job_control(JOB)["last_effect"]["rolled_back"] is True
    # The rolled-back split is not tried again.
    j.ack_all(last.version)
    j.steps(20, shares=last.shares, version=last.version)
    j.tick()
    assert [m.shares for m in j.socks[0].sent].count(new.shares) == 1


def test_static_strategy_proposes_before_any_step(make):
    j = make("auto", default_strategy="static")
    j.hello(devices=("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"))
    assert j.k == 0
    sent = j.socks[0].sent
    assert len(sent) == 1 and sent[0].shares[0] > sent[0].shares[2] and sum(sent[0].shares) == B


def test_overrides_drive_a_new_placement_in_auto_mode(make):
    j = make("auto")
    j.hello()
    j.steps(3)
    out = asyncio.run(j.ctl.set_overrides(JOB, {"drains": [1]}, actor=OPERATOR, reason="rank 1 flaky"))
    assert out["proposal_id"] is not None
    assert j.socks[0].sent[-1].shares[1] == 0


def test_switching_to_auto_applies_the_proposal_on_the_table(make):
    j = make("approve")
    j.start(12)
    pid = j.ctl.job_control(JOB)["pending_proposal_id"]
    asyncio.run(j.ctl.set_mode(JOB, "auto", actor=OPERATOR, reason="go hands-off"))
    j.steps(1)
    j.tick()
    assert asyncio.run(j.ctl.proposals(JOB))[0]["id"] == pid  # no new proposal: the same one was applied
    assert asyncio.run(j.ctl.proposals(JOB))[0]["status"] == "approved" and j.socks[0].sent[-1].proposal_id == pid


def test_auto_mode_moves_whole_granules_when_the_move_cap_is_smaller_than_one(make):
    # 0.125 * 48 = 6 samples, but with granularity 8 a rank moves 8 at a time: the cap is
    # raised to one granule (as the policy's own guardrail does), or nothing could move.
    j = make("auto", auto_max_move_fraction=0.125)
    j.hello()
    out = asyncio.run(j.ctl.set_overrides(JOB, {"granularity": 8}, actor=OPERATOR, reason="tiles"))
    assert out["proposal_id"] is None  # 16/16/16 already respects it
    j.steps(12, per_sample_ms=(1.0, 1.0, 8.0))
    j.tick()
    sent = [m.shares for m in j.socks[0].sent]
    assert len(sent) == 1 and sent[0][2] == 8 and sum(sent[0]) == B
    assert all(v % 8 == 0 and abs(v - 16) <= 8 for v in sent[0])


def test_a_rolled_back_direction_is_not_retried_with_a_slightly_different_split(make):
    # Issue 13: only exact repeats of a rolled-back split were blocked, so a nearly
    # identical one went out again. The direction stays blocked until a moved rank's
    # measured cost changes.
    j = make("auto", rollback_threshold=0.05)
    _, back = _applied_then_rolled_back(j)
    assert back.shares == [16, 16, 16]
    j.ack_all(back.version)
    # Rank 2 a little slower than before (7%): the policy's split differs from the undone
    # one, but it moves work the same way; nothing goes out.
    j.steps(30, shares=back.shares, version=back.version, per_sample_ms=(1.0, 1.0, 4.3))
    j.tick()
    assert j.socks[0].sent[-1].version == back.version
    # Once rank 2 is measured 2x slower than when the change was undone, it may move again.
    j.steps(30, shares=back.shares, version=back.version, per_sample_ms=(1.0, 1.0, 8.0))
    j.tick()
    again = j.socks[0].sent[-1]
    assert again.version == back.version + 1 and again.shares[2] < 16


def test_a_drained_rank_keeps_its_last_measured_cost(make):
    # Issue 13: once a very slow rank was drained to 0 and its measured steps left the
    # window, the policy assumed the median speed for it and auto mode gave it work back.
    j = make("auto", auto_max_move_fraction=1.0, policy_window_steps=20)
    j.hello()
    slow = (1.0, 1.0, 100.0)
    j.steps(12, per_sample_ms=slow)
    j.tick()
    drained = j.socks[0].sent[-1]
    assert drained.shares[2] == 0
    j.ack_all(drained.version)
    j.steps(60, shares=drained.shares, version=drained.version, per_sample_ms=slow)
    j.tick()
    assert j.socks[0].sent[-1].version == drained.version
    control = j.ctl.job_control(JOB)
    assert control["status"] == "balanced", control


def test_a_fitted_cost_model_is_shown_in_observe_mode_and_sent_in_approve_mode(make, tmp_path):
    """Sample lengths whose step times follow c + a*sum(L) + b*sum(L^2) (issue 23, item 2)."""
    import random

    j = make("observe")
    j.hello()
    rng = random.Random(4)

    def steps(n: int) -> None:
        st = j.ctl.job_control(JOB)
        shares, version = st["placement"]["shares"], st["placement"]["version"]
        for _ in range(n):
            sums = []
            for share in shares:
                lens = [rng.randint(1000, 3000) if rng.random() < 0.2 else rng.randint(20, 200) for _ in range(share)]
                sums.append((float(sum(lens)), float(sum(v * v for v in lens))))
            b1, b2 = sum(s1 for s1, _ in sums), sum(s2 for _, s2 in sums)  # the global batch's
            for r, (share, (s1, s2)) in enumerate(zip(shares, sums, strict=True)):
                ms = 1.0 + 0.002 * s1 + 1e-5 * s2
                rec = StepRecord(batch_index=j.k, local_batch_size=share, placement_version=version,
                                 data_wait_ms=0.1, compute_ms=ms, sync_wait_ms=0.0, optimizer_ms=0.3,
                                 step_ms=ms + 1.0, t=1000.0 + j.k, work=s1, batch_work=b1,
                                 work_sq=s2, batch_work_sq=b2)
                j.svc.live.add_metrics(Metrics(job=JOB, rank=r, steps=[rec]))
            j.k += 1

    steps(30)
    j.tick()
    model = j.ctl.job_control(JOB)["cost_model"]
    assert model["model"] == "fitted a*L+b*L^2" and model["ranks_quadratic"] == 3, model
    assert model["length_sq_weight"] == pytest.approx(1e-5 / 0.002, rel=0.05)
    assert model["length_sq_weight_in_force"] == 0.0 and "observe mode" in model["detail"]
    assert all(s.sent == [] for s in j.socks)  # observe: shown, never sent

    asyncio.run(j.ctl.set_mode(JOB, "approve", actor=OPERATOR))
    j.tick()
    sent = [s.sent[-1] for s in j.socks]
    k = model["length_sq_weight"]
    assert all(m.length_sq_weight == pytest.approx(k, rel=0.05) and m.shares == [16, 16, 16] for m in sent)
    placements = asyncio.run(j.ctl.placements(JOB))
    assert placements[0]["source"] == "cost_model" and placements[0]["version"] == sent[0].version
    control = j.ctl.job_control(JOB)
    assert control["cost_model"]["length_sq_weight_in_force"] == sent[0].length_sq_weight
    assert "observe mode" not in control["cost_model"]["detail"]
    audit = asyncio.run(j.ctl.audit(JOB))
    assert any(a["action"] == "placement.cost_model" for a in audit)
    # Every later placement carries the k in force; the same k again sends nothing new.
    j.ack_all(sent[0].version)
    steps(10)
    j.tick()
    assert [p["source"] for p in asyncio.run(j.ctl.placements(JOB))].count("cost_model") == 1
    # A restarted backend keeps the k in force (its hello replies carry it, not 0).
    again = Job(tmp_path / "0", "approve")
    try:
        asyncio.run(again.ctl.placements(JOB))  # loads the job from SQL
        assert again.ctl.job_control(JOB)["cost_model"]["length_sq_weight_in_force"] == sent[0].length_sq_weight
    finally:
        again.close()

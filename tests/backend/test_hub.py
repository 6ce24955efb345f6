"""DashboardHub: coalescing, per-client isolation, snapshot + deltas, counterfactual."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from backend.dashboard.hub import DashboardHub, JobChanges
from backend.live.state import LiveState
from backend.settings import Settings
from rebalancer_wire.protocol import DeviceSample, Hello, MeshShape, Metrics, StepRecord

WORLD, GBS = 3, 24


def _run_async(fn):
    """Run an async test body on a fresh event loop (no pytest-asyncio here)."""
    def wrapper():
        asyncio.run(fn())
    wrapper.__name__ = fn.__name__
    return wrapper


def _services(hz: float = 10.0) -> SimpleNamespace:
    settings = Settings(dashboard_max_hz=hz, db="sqlite:///:memory:")
    live = LiveState(step_buffer=256, device_buffer=16, window_steps=8)
    return SimpleNamespace(settings=settings, live=live, control={}, fit=None)


def _hub(svc: SimpleNamespace, **kw) -> DashboardHub:
    """A hub over ``svc.live`` whose control snapshot is ``svc.control`` (every job)."""
    return DashboardHub(settings=svc.settings, live=svc.live, control=lambda job: svc.control,
                        cost_fit=lambda job: svc.fit, changes=JobChanges(), **{"owner": None, **kw})


def _register(live: LiveState, job: str = "j", world: int = WORLD) -> None:
    for r in range(world):
        live.register(Hello(job=job, rank=r, world_size=world, global_batch_size=GBS,
                            device_type="H100" if r else "A100", host="h"))


def _feed(live: LiveState, b: int, *, job: str = "j", per_sample=(1.0, 1.0, 4.0),
          shares=(8, 8, 8), version: int = 0, ranks=None) -> None:
    """Batch ``b`` for every rank: compute = per_sample[r] * share, step = max compute + 1."""
    step = max(per_sample[r] * shares[r] for r in range(len(shares))) + 1.0
    for r in ranks if ranks is not None else range(len(shares)):
        rec = StepRecord(batch_index=b, local_batch_size=shares[r], placement_version=version,
                         data_wait_ms=0.1, compute_ms=per_sample[r] * shares[r],
                         sync_wait_ms=step - per_sample[r] * shares[r] - 1.0, optimizer_ms=0.5,
                         step_ms=step, t=1000.0 + b * step / 1000)
        dev = DeviceSample(t=1000.0 + b, source="nvml", util_pct=50.0 + r, power_w=300.0,
                           throttle_reasons=["sw_thermal"] if r == 2 else [])
        live.add_metrics(Metrics(job=job, rank=r, steps=[rec], device=[dev]))


class FakeSocket:
    """Collects frames; ``gate`` (when set) blocks every send until released."""

    def __init__(self, gate: asyncio.Event | None = None):
        self.frames: list[dict] = []
        self.gate = gate

    async def send(self, text: str) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.frames.append(json.loads(text))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_notify_only_marks_dirty():
    hub = _hub(_services())
    for _ in range(1000):
        hub.notify("j")
    assert hub.changes.take() == {"j"}
    assert hub.ticks == 0


@_run_async
async def test_many_notifies_one_frame_per_tick():
    svc = _services()
    _register(svc.live)
    hub = _hub(svc, clock=lambda: 0.0)  # frozen clock: no idle refresh after the first
    sock = FakeSocket()
    task = asyncio.create_task(hub.attach(sock.send, "j"))
    await _settle()
    assert len(sock.frames) == 1 and sock.frames[0]["full"] is True  # snapshot on connect
    for tick in range(5):
        for b in range(tick * 10, tick * 10 + 10):
            _feed(svc.live, b)
            for _ in range(50):  # ingest notifies per metrics message
                hub.notify("j")
        hub.tick()
        await _settle()
    task.cancel()
    # 2500 notifies over 5 ticks: exactly one frame per tick after the snapshot.
    assert len(sock.frames) == 1 + 5
    assert all(f["full"] is False for f in sock.frames[1:])
    got = [b for f in sock.frames for b in f["series"]["b"]]
    assert got == sorted(set(got)) and got[-1] == 49  # each batch once, in order
    assert hub.ticks == 5


@_run_async
async def test_real_ticker_never_exceeds_max_hz():
    svc = _services(hz=10.0)
    _register(svc.live)
    hub = _hub(svc)
    hub.interval_s = 0.01  # run fast; the bound is frames <= ticks whatever the rate
    sock = FakeSocket()
    await hub.start()
    task = asyncio.create_task(hub.attach(sock.send, "j"))
    for b in range(200):
        _feed(svc.live, b)
        hub.notify("j")
        if b % 7 == 0:
            await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    await hub.stop()
    task.cancel()
    assert 1 < len(sock.frames) <= hub.ticks + 1  # +1: the snapshot on connect
    assert len(sock.frames) < 200


@_run_async
async def test_slow_client_does_not_block_others_and_coalesces():
    svc = _services()
    _register(svc.live)
    hub = _hub(svc, clock=lambda: 0.0)
    gate = asyncio.Event()
    slow, fast = FakeSocket(gate), FakeSocket()
    tasks = [asyncio.create_task(hub.attach(s.send, "j")) for s in (slow, fast)]
    await _settle()
    for b in range(30):
        _feed(svc.live, b)
        hub.notify("j")
        hub.tick()
        await _settle()
    assert len(fast.frames) == 31 and slow.frames == []  # slow is stuck in its first send
    gate.set()
    await _settle()
    # The slow client got its snapshot then one frame holding everything it missed.
    assert len(slow.frames) == 2
    assert slow.frames[0]["full"] and not slow.frames[1]["full"]
    got = slow.frames[0]["series"]["b"] + slow.frames[1]["series"]["b"]
    assert got == list(range(30))
    for t in tasks:
        t.cancel()


@_run_async
async def test_job_frame_content_and_uniform_counterfactual():
    svc = _services()
    svc.fit = ((0.0, 0.0, 0.0), (1.0, 1.0, 4.0))  # the policy's per-rank fit (exact here)
    _register(svc.live)
    hub = _hub(svc, clock=lambda: 0.0)
    for b in range(10):  # uniform split: rank 2 is 4x slower per sample
        _feed(svc.live, b)
    for b in range(10, 20):  # rebalanced: 12/9/3 so compute is 12/9/12
        _feed(svc.live, b, shares=(12, 9, 3), version=1)
    hub.notify("j")
    hub.tick()
    sock = FakeSocket()
    task = asyncio.create_task(hub.attach(sock.send, "j"))
    await _settle()
    task.cancel()
    f = sock.frames[0]
    assert f["type"] == "job" and f["full"]
    s = f["series"]
    assert s["b"] == list(range(20))
    assert s["max_compute_ms"][0] == 32.0 and s["max_compute_ms"][-1] == 12.0
    # The fits are exact (a=0), so the counterfactual equals the measured uniform step.
    assert s["uniform_step_ms"][-1] == pytest.approx(s["step_ms"][0])
    assert s["throughput"][-1] == pytest.approx(GBS * 1000 / 13.0, rel=1e-3)
    assert f["markers"] == [{"b": 10, "version": 1}]
    assert f["savings"]["saved_s"] == pytest.approx(10 * (33.0 - 13.0) / 1000)
    assert f["ranks"]["rank"] == [0, 1, 2]
    assert f["ranks"]["throttle_reasons"][2] == ["sw_thermal"]
    assert f["ranks"]["price_per_hour"] == [1.6, 3.0, 3.0]
    assert f["summary"]["cost_per_hour"] == pytest.approx(7.6)
    assert len(f["heat"]) == 1 and len(f["heat"][0]["compute"]) == WORLD
    assert f["heat"][0]["util"] == [50.0, 51.0, 52.0]
    # Every phase has its heatmap row (the page's picker): each rank's mean over the batches read.
    col = f["heat"][0]
    assert col["data_wait"] == [pytest.approx(0.1)] * WORLD and col["optimizer"] == [pytest.approx(0.5)] * WORLD
    assert col["step"] == [pytest.approx(23.0)] * WORLD  # 10 steps of 33 ms, 10 of 13
    assert col["compute"] == [pytest.approx(10.0), pytest.approx(8.5), pytest.approx(22.0)]
    assert "gc" not in col and "host" not in col and "ckpt" not in col  # no rank sends those phases


@_run_async
async def test_a_mesh_jobs_summary_carries_its_shape():
    svc = _services()
    mesh = MeshShape(dp=2, replica_size=2, dims=("dp", "tp"), shape=(2, 2))
    for r in range(2):
        svc.live.register(Hello(job="m", rank=r, world_size=2, global_batch_size=GBS, mesh=mesh))
    _register(svc.live, job="plain")
    hub = _hub(svc, clock=lambda: 0.0)
    frames = {}
    for job in ("m", "plain"):
        _feed(svc.live, 0, job=job, shares=(12, 12) if job == "m" else (8, 8, 8))
        hub.notify(job)
        hub.tick()
        sock = FakeSocket()
        task = asyncio.create_task(hub.attach(sock.send, job))
        await _settle()
        task.cancel()
        frames[job] = sock.frames[0]["summary"]
    assert frames["m"]["mesh"] == {"dp": 2, "replica_size": 2, "dims": ["dp", "tp"], "shape": [2, 2],
                                   "label": "DP 2 x TP 2"}
    assert frames["plain"]["mesh"] is None


@_run_async
async def test_batch_waits_for_lagging_rank_then_closes():
    svc = _services()
    _register(svc.live)
    hub = _hub(svc, clock=lambda: 0.0)
    for b in range(5):
        _feed(svc.live, b, ranks=[0, 1])  # rank 2 has not sent these yet
    hub.notify("j")
    hub.tick()
    assert hub._feeds["j"].series == type(hub._feeds["j"].series)()
    for b in range(5):
        _feed(svc.live, b, ranks=[2])
    hub.notify("j")
    hub.tick()
    assert [p["b"] for p in hub._feeds["j"].series] == [0, 1, 2, 3, 4]


@_run_async
async def test_overview_frame_lists_jobs():
    svc = _services()
    _register(svc.live, "a")
    _register(svc.live, "b", world=2)
    _feed(svc.live, 0, job="a")
    hub = _hub(svc, clock=lambda: 0.0)
    sock = FakeSocket()
    task = asyncio.create_task(hub.attach(sock.send, None))
    await _settle()
    task.cancel()
    jobs = sock.frames[0]["jobs"]
    assert [j["job"] for j in jobs] == ["a", "b"]
    assert jobs[0]["world_size"] == 3 and jobs[1]["world_size"] == 2
    assert jobs[1]["status"] == "warming_up"


@_run_async
async def test_no_uniform_estimate_before_the_policy_fitted_the_job():
    svc = _services()
    _register(svc.live)
    hub = _hub(svc, clock=lambda: 0.0)
    for b in range(5):  # version 0, the uniform split: each step is its own uniform step
        _feed(svc.live, b)
    for b in range(5, 8):  # a new split, no fit to predict the uniform one with
        _feed(svc.live, b, shares=(12, 9, 3), version=1)
    hub.notify("j")
    hub.tick()
    series = list(hub._feeds["j"].series)
    assert [p["uniform_step_ms"] for p in series] == [p["step_ms"] for p in series[:5]] + [None] * 3
    assert hub.savings("j")["saved_s"] == 0.0


def test_disconnected_rank_does_not_hold_the_series():
    svc = _services()
    _register(svc.live)
    hub = _hub(svc, clock=lambda: 0.0)
    for b in range(3):
        _feed(svc.live, b)
    svc.live.set_connected("j", 2, False)  # rank 2 died after batch 2
    for b in range(3, 6):
        _feed(svc.live, b, ranks=[0, 1])
    hub.notify("j")
    hub.tick()
    pts = list(hub._feeds["j"].series)
    assert [p["b"] for p in pts] == [0, 1, 2, 3, 4, 5]
    assert pts[2]["max_compute_ms"] == 32.0 and pts[3]["max_compute_ms"] == 8.0


@_run_async
async def test_big_job_sends_rank_columns_once_a_second_and_positions_between():
    world = 200  # above the per-tick limit for per-rank columns
    svc = _services()
    for r in range(world):
        svc.live.register(Hello(job="j", rank=r, world_size=world, global_batch_size=8 * world,
                                device_type="H100", host="h"))
    control = {"mode": "observe", "placement": {"version": 0, "shares": [8] * world}}
    svc.control = control
    now = [0.0]
    hub = _hub(svc, clock=lambda: now[0])
    sock = FakeSocket()
    task = asyncio.create_task(hub.attach(sock.send, "j"))
    await _settle()
    for b in range(12):  # ten ticks a second for 1.2 s
        # Rank 0 computes 8 ms a batch for batches 0 to 9, then 80 ms.
        _feed(svc.live, b, per_sample=(1.0 if b < 10 else 10.0,) + (1.0,) * (world - 1), shares=(8,) * world)
        now[0] = (b + 1) * 0.1
        hub.notify("j")
        hub.tick()
        await _settle()
    first, later = sock.frames[0], sock.frames[1:]
    assert first["full"] and len(first["ranks"]["rank"]) == world and first["control"] == control
    with_ranks = [f for f in later if "ranks" in f]
    assert len(with_ranks) == 1  # one rebuild in 1.2 s after the snapshot's
    for f in later:  # every frame shows where every rank is, one way or the other
        cols = f["ranks"] if "ranks" in f else f["positions"]
        assert cols["rank"] == list(range(world))
        assert cols["batch_index"] == [f["summary"]["batch_index"]] * world
    assert all("control" not in f for f in later)  # unchanged: not sent again
    # Heat columns too go out once a second, each the mean over the batches read since the
    # previous one: the snapshot's (batch 0), then batches 1 to 10 at 1.0 s.
    heat = [c for f in sock.frames for c in f["heat"]]
    assert [c["b"] for c in heat] == [0, 10]
    assert heat[1]["compute"][0] == pytest.approx((9 * 8.0 + 80.0) / 10) and heat[1]["compute"][1] == 8.0
    assert len(heat[1]["util"]) == world and heat[1]["util"][5] == 55.0
    svc.control = {**control, "mode": "approve"}  # the controller published a change
    now[0] += 0.1
    hub.notify("j")
    hub.tick()
    await _settle()
    task.cancel()
    assert len(sock.frames) == 1 + len(later) + 1
    assert sock.frames[-1]["control"]["mode"] == "approve"  # changed: sent once more


@_run_async
async def test_a_client_that_connects_between_ticks_gets_the_newest_state_at_once():
    """CI found a dashboard's first frame one tick behind REST: a feed folded at hello time,
    steps that arrived after, and a client connecting before the next tick got the old
    summary (no times). A new client's snapshot folds what is pending first."""
    svc = _services()
    _register(svc.live)
    hub = _hub(svc, clock=lambda: 0.0)  # frozen clock: no tick runs unless called
    hub.notify("j")
    hub.tick()  # the feed exists, folded before any step
    for b in range(3):
        _feed(svc.live, b)
    hub.notify("j")  # ingest marked it; the next tick has not run
    frames = {}
    for job in ("j", None):
        sock = FakeSocket()
        task = asyncio.create_task(hub.attach(sock.send, job))
        await _settle()
        task.cancel()
        frames[job] = sock.frames[0]
    assert frames["j"]["series"]["b"] == [0, 1, 2]
    assert frames["j"]["summary"]["batch_index"] == 2
    assert [j["batch_index"] for j in frames[None]["jobs"]] == [2]
    # The pending mark stays: the next tick still wakes the job's other clients.
    assert hub.changes.take() == {"j"}


@_run_async
async def test_a_job_whose_fold_is_dear_is_folded_once_it_is_paid_for():
    """A fold of thousands of ranks costs tens of milliseconds; ten a second were most of a
    replica's CPU at 1 step/s (bench.capacity, 8,192 ranks). Such a job is folded again once
    ten times its cost has passed (at most every half second); a cheap job every tick."""
    svc = _services()
    _register(svc.live)
    t, cost = [0.0], [0.0]
    hub = _hub(svc, clock=lambda: t[0])
    fold = hub._update

    def dear(job: str, now: float) -> None:  # a fold that takes cost[0] seconds of the hub's clock
        fold(job, now)
        t[0] += cost[0]

    hub._update = dear  # type: ignore[method-assign]
    sock = FakeSocket()
    task = asyncio.create_task(hub.attach(sock.send, "j"))
    await _settle()

    def run(ticks: int) -> list[int]:
        folded = []
        for b in range(ticks):
            before = hub._feeds["j"].updated_at if "j" in hub._feeds else None
            t[0] += 0.1  # one tick interval (10 Hz)
            _feed(svc.live, b)
            hub.notify("j")
            hub.tick()
            folded.append(int(hub._feeds["j"].updated_at != before))
        return folded

    assert run(5) == [1, 1, 1, 1, 1]  # free folds: every tick
    cost[0] = 0.03  # a fold now costs 30 ms: folded again 300 ms after the last
    assert run(9) == [1, 0, 0, 1, 0, 0, 1, 0, 0]
    assert "j" in hub.changes.take()  # a skipped job stays marked for the next tick
    cost[0] = 0.5  # a fold of half a second: still every half second (the screen stays live)
    assert run(3) == [1, 1, 1]
    task.cancel()

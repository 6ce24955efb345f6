"""LiveState's derived numbers and persistence windows; Settings' start-up refusals."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from pydantic import ValidationError

from backend.live.state import LiveState
from backend.settings import DEFAULT_DEVICE_PRICES, Settings, is_loopback
from rebalancer_wire.protocol import DeviceSample, Hello, Metrics, StepRecord
from tests.backend._app import steps
from tests.helpers.torchrun import REPO_ROOT


def _live(world: int = 3, window: int = 4) -> LiveState:
    live = LiveState(step_buffer=8, device_buffer=2, window_steps=window)
    for r in range(world):
        live.register(Hello(job="j", rank=r, world_size=world, global_batch_size=30), now=100.0)
    return live


def test_derived_numbers_use_the_recent_window():
    live = _live()
    live.add_metrics(Metrics(job="j", rank=0, steps=steps(0, 4, compute_ms=99.0, step_ms=100.0, t0=0.0)))
    for r, c in ((0, 10.0), (1, 10.0), (2, 40.0)):
        live.add_metrics(Metrics(job="j", rank=r, steps=steps(4 if r == 0 else 0, 4, compute_ms=c,
                                                              step_ms=50.0, t0=0.0)))
    v = live.view("j")
    assert [r.compute_ms for r in v.ranks] == [10.0, 10.0, 40.0]  # rank 0's old 99s left the window
    assert v.imbalance == pytest.approx(40 / 20 - 1)
    assert v.idle_fraction == pytest.approx(1 - 20 / 40)
    assert v.step_ms == 50.0 and v.batch_index == 7
    assert v.ranks[1].step_rate_hz == pytest.approx(20.0)  # 3 intervals of 50 ms
    assert v.connected_ranks == 3


@pytest.mark.parametrize(("buffer", "window"), [(8, 4), (4, 4), (64, 5)])
def test_window_means_follow_every_row_as_it_arrives(buffer: int, window: int):
    # After every message the view's means, rate and position are those of the newest
    # ``window`` rows, through the ring's eviction (buffer == window), a 10^6 ms outlier
    # leaving the window, and messages longer than the window.
    live = LiveState(step_buffer=buffer, device_buffer=2, window_steps=window)
    live.register(Hello(job="j", rank=0, world_size=1, global_batch_size=8), now=100.0)
    sent: list[StepRecord] = []
    rng = random.Random(5)
    b = 0
    for n in [1, 3, 2, 7, 1, 1, 5, 4, 9] * 8:
        recs = [StepRecord(batch_index=b + i, local_batch_size=8, placement_version=0,
                           data_wait_ms=rng.uniform(0, 2), compute_ms=1e6 if b + i == 9 else rng.uniform(1, 90),
                           sync_wait_ms=rng.uniform(0, 5), optimizer_ms=0.1 * i, step_ms=rng.uniform(50, 150),
                           t=1000.0 + 0.1 * (b + i)) for i in range(n)]
        b += n
        sent += recs
        live.add_metrics(Metrics(job="j", rank=0, steps=recs))
        rv = live.view("j").ranks[0]  # type: ignore[union-attr]
        win = sent[-window:]
        for f in ("compute_ms", "sync_wait_ms", "data_wait_ms", "optimizer_ms", "step_ms"):
            assert getattr(rv, f) == pytest.approx(sum(getattr(s, f) for s in win) / len(win), rel=1e-12, abs=1e-9), f
        assert rv.batch_index == b - 1 and rv.n_steps == min(len(sent), buffer)
        if len(win) >= 2:
            assert rv.step_rate_hz == pytest.approx((len(win) - 1) / (win[-1].t - win[0].t))


def test_ring_buffers_bound_memory_and_count_drops():
    live = _live(world=1)
    dev = [DeviceSample(t=float(i), source="psutil", cpu_pct=float(i)) for i in range(5)]
    live.add_metrics(Metrics(job="j", rank=0, steps=steps(0, 20), device=dev, dropped=7))
    assert len(live.recent_steps("j", 0)) == 8
    assert [s.batch_index for s in live.recent_steps("j", 0, 3)] == [17, 18, 19]
    assert [d.cpu_pct for d in live.recent_device("j", 0)] == [3.0, 4.0]
    assert live.view("j").ranks[0].dropped == 7 and live.dropped_total == 7
    assert live.records_total == 25 and live.messages_total == 1


def test_steps_filter_and_windows_cover_everything_once():
    live = _live(world=2)
    live.add_metrics(Metrics(job="j", rank=0, steps=steps(0, 6)))
    live.add_metrics(Metrics(job="j", rank=1, steps=steps(0, 6)))
    picked = live.steps("j", ranks={1}, batch_from=2, batch_to=4)
    assert [(r, s.batch_index) for r, s in picked] == [(1, 2), (1, 3), (1, 4)]
    assert [s.batch_index for _, s in live.steps("j", limit=2)] == [5, 5]
    w = live.drain_windows()
    assert sorted((x.rank, x.n_steps, x.batch_index_start, x.batch_index_end) for x in w) == [(0, 6, 0, 5), (1, 6, 0, 5)]
    assert live.drain_windows() == []
    live.add_metrics(Metrics(job="j", rank=0, dropped=5))  # drops with no steps wait for the next window
    assert live.drain_windows() == []
    live.add_metrics(Metrics(job="j", rank=0, steps=steps(6, 1)))
    assert [(x.n_steps, x.dropped) for x in live.drain_windows()] == [(1, 5)]


def test_new_run_with_other_shape_resets_ranks_but_reconnect_keeps_history():
    live = _live(world=2)
    live.add_metrics(Metrics(job="j", rank=0, steps=steps(0, 3)))
    live.set_connected("j", 0, False)
    assert live.register(Hello(job="j", rank=0, world_size=2, global_batch_size=30)) is False
    assert live.view("j").ranks[0].n_steps == 3 and live.view("j").ranks[0].connected
    assert live.register(Hello(job="j", rank=0, world_size=4, global_batch_size=30)) is True
    assert [r.rank for r in live.view("j").ranks] == [0] and live.view("j").ranks[0].n_steps == 0


@pytest.mark.parametrize(
    "env, message",
    [
        ({"port": 70000}, "REBALANCER_PORT must be between 0 and 65535, got 70000."),
        ({"db": "mysql://x"}, "REBALANCER_DB must be a sqlite:///path or postgresql://user@host/db URL"),
        ({"admin_token": "short"}, "REBALANCER_ADMIN_TOKEN must be at least 16 characters"),
        ({"dashboard_max_hz": 0}, "REBALANCER_DASHBOARD_MAX_HZ must be above 0 and at most 10"),
        ({"device_prices": {"H100": -1}}, "REBALANCER_DEVICE_PRICES must map device types to prices >= 0"),
        ({"proposal_ttl_s": 0}, "REBALANCER_PROPOSAL_TTL_S must be a number between 1 and 604800, got 0.0."),
        ({"min_gain": 2}, "REBALANCER_MIN_GAIN must be a number between 0 and 0.99, got 2.0."),
        ({"proposal_margin": 0.9}, "REBALANCER_PROPOSAL_MARGIN must be a number between 0 and 0.5, got 0.9."),
        ({"ws_max_bytes": 1000}, "REBALANCER_WS_MAX_BYTES must exceed the protocol limit"),
        ({"default_mode": "yolo"}, "Input should be 'observe', 'approve' or 'auto'"),
    ],
)
def test_unsafe_settings_are_refused(env, message):
    with pytest.raises(ValidationError) as exc:
        Settings(**env)
    assert message in str(exc.value)


def test_settings_from_environment_and_prices(monkeypatch):
    monkeypatch.setenv("REBALANCER_PORT", "9001")
    monkeypatch.setenv("REBALANCER_DEVICE_PRICES", '{"H100": 2.5, "A100": 1.0}')
    s = Settings()
    assert s.port == 9001 and s.default_mode == "approve"
    assert s.price_for("H100") == 2.5
    assert s.price_for("cuda", "NVIDIA A100-SXM4-80GB") == 1.0
    assert s.price_for("cuda", "Mystery GPU") is None
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


def test_prices_name_devices_by_the_one_device_key_rule():
    # The probe's device_key and pricing agree on every driver name: the A10 is priced as
    # the A10G, a 40 GB A100 as an A100 (not as the 80 GB one), whatever the spelling.
    s = Settings()
    assert s.price_for("", "NVIDIA A10") == DEFAULT_DEVICE_PRICES["A10G"]
    assert s.price_for("", "NVIDIA A100-SXM4-40GB") == DEFAULT_DEVICE_PRICES["A100"]
    assert s.price_for("", "NVIDIA A100 80GB PCIe") == DEFAULT_DEVICE_PRICES["A100-80GB"]
    assert s.price_for("A100-40GB", "") == DEFAULT_DEVICE_PRICES["A100"]
    assert s.price_for("CPU", "x86_64") == DEFAULT_DEVICE_PRICES["cpu"]
    # A key the operator adds for a device the table does not know still matches its name.
    own = Settings(device_prices={"RTX 4090": 0.4})
    assert own.price_for("", "NVIDIA GeForce RTX 4090") == 0.4


@pytest.mark.multiproc
def test_backend_import_does_not_pull_in_torch():
    code = "import sys, backend.main, backend.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, timeout=60).returncode == 0


def test_full_collections_run_on_the_schedule_and_the_thresholds_come_back(tmp_path):
    # backend.heap: young collections every 100,000 allocations, the oldest generation
    # only on the timer (REBALANCER_GC_FULL_INTERVAL_S), Python's thresholds restored when
    # the app stops (in-process apps share the interpreter).
    import gc

    from fastapi.testclient import TestClient

    from backend import heap
    from backend.main import create_app
    from tests.helpers.waiting import wait_until

    before = gc.get_threshold()
    app = create_app(Settings(db=f"sqlite:///{tmp_path / 'r.db'}", gc_freeze=False, gc_full_interval_s=0.2))
    with TestClient(app) as client:
        young, middle, oldest = gc.get_threshold()
        assert (young, middle) == (heap.YOUNG_THRESHOLD, heap.MIDDLE_THRESHOLD) and oldest >= 2**31 - 1
        full = gc.get_stats()[2]["collections"]
        wait_until(lambda: gc.get_stats()[2]["collections"] >= full + 2, "two scheduled full collections",
                   timeout=20)
        assert client.get("/healthz").status_code == 200
    assert gc.get_threshold() == before


def test_python_keeps_its_own_collection_schedule_with_interval_0(tmp_path):
    import gc

    from fastapi.testclient import TestClient

    from backend.main import create_app

    before = gc.get_threshold()
    with TestClient(create_app(Settings(db=f"sqlite:///{tmp_path / 'r.db'}", gc_freeze=False,
                                        gc_full_interval_s=0))):
        assert gc.get_threshold() == before

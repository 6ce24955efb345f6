"""Training keeps running at full speed when no backend is reachable (docs/design.md, invariant 3)."""

from __future__ import annotations

import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.ports import free_port
from tests.helpers.server import running_server
from tests.helpers.torchrun import run_torchrun
from trainer_hook import transport as transport_module
from trainer_hook.hook import RebalanceHook

STEPS = 40
WARMUP = 5  # first steps pay for start-up (thread start, first collectives)


def _median_step_ms(result: dict[str, Any]) -> float:
    """Median wall step time over every rank's steps after warm-up."""
    per_rank = result["records"]
    return statistics.median(r["step_ms"] for recs in per_rank for r in recs[WARMUP:])


def _run_demo(tmp_path: Path, name: str, server: str | None) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    args = ["-m", "trainer_hook.demo_worker", "--job", "offline", "--steps", str(STEPS),
            "--global-batch-size", "16", "--speeds", "1,1", "--per-sample-ms", "1.5", "--fixed-ms", "2",
            "--result", str(out)]
    if server is not None:
        args += ["--server", server]
    # No REBALANCER_* from the caller's environment may turn the "no server" run online.
    env = {"REBALANCER_SERVER": "", "REBALANCER_TOKEN": ""} if server is None else {}
    proc = run_torchrun(2, args, env=env, timeout=240)
    result: dict[str, Any] = json.loads(out.read_text())
    result["output"] = proc.stdout + proc.stderr
    return result


@pytest.mark.multiproc
def test_torchrun_job_with_unreachable_backend_runs_at_full_speed(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    offline = _run_demo(tmp_path, "offline", None)
    unreachable = _run_demo(tmp_path, "unreachable", dead)
    for res in (offline, unreachable):
        assert res["world_size"] == 2
        assert [len(recs) for recs in res["records"]] == [STEPS, STEPS]  # every rank finished
        assert [r["batch_index"] for r in res["records"][1]] == list(range(STEPS))
    ratio = _median_step_ms(unreachable) / _median_step_ms(offline)
    assert ratio < 1.5, (ratio, _median_step_ms(unreachable), _median_step_ms(offline))
    # Training stays on the placement it has: version 0, uniform.
    assert unreachable["placements"][-1]["shares"] == [8, 8]


def _tiny_loop(hook: RebalanceHook, steps: int) -> list[float]:
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    model = torch.nn.Linear(8, 1)
    hook.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(ds, batch_sampler=hook.batch_sampler(ds, shuffle=True, seed=0))
    step_ms: list[float] = []
    while hook.batch_index < steps:
        for x, y in loader:
            t0 = time.perf_counter()
            with hook.step():
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            step_ms.append((time.perf_counter() - t0) * 1e3)
            if hook.batch_index >= steps:
                break
    return step_ms


@pytest.mark.multiproc
def test_hook_counts_drops_offline_and_reports_them_after_reconnect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "REBALANCER_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    # Cap the reconnect back-off (30 s by default) so the test does not wait out a long retry
    # while the backend starts; what is tested is the drop count, not the back-off.
    monkeypatch.setattr(transport_module, "Transport", functools.partial(transport_module.Transport, backoff_max_s=1.0))
    port = free_port()  # the backend will start here later
    hook = RebalanceHook(server=f"http://127.0.0.1:{port}", job="drops", global_batch_size=8,
                         max_queue=10, startup_wait_s=0.2)
    try:
        _tiny_loop(hook, 30)
        assert not hook.connected
        assert hook.dropped == 20  # 30 step records into 10 slots (+ device samples, if any)
        with running_server(tmp_path, port=port) as server:
            deadline = time.monotonic() + 60
            ranks: list[dict[str, Any]] = []
            while time.monotonic() < deadline:
                try:
                    body = server.get("/api/v1/jobs/drops/ranks")
                    ranks = body["data"]  # type: ignore[index]
                except OSError:
                    ranks = []
                if ranks and ranks[0]["dropped"] >= 20 and ranks[0]["n_steps"] >= 10:
                    break
                time.sleep(0.2)
            assert hook.connected, server.log()
            assert ranks and ranks[0]["dropped"] == hook.dropped >= 20, ranks
            # The ten newest records made it across.
            assert ranks[0]["n_steps"] == 10
            assert ranks[0]["batch_index"] == 29
    finally:
        hook.close()

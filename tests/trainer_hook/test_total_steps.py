"""The run's length (total_steps) travels from the hook to the backend's ETA, end to end."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.server import running_server
from tests.helpers.waiting import wait_until
from trainer_hook import RebalanceHook
from trainer_hook.config import HookConfig


def test_total_steps_from_argument_or_environment() -> None:
    assert HookConfig(global_batch_size=8).total_steps is None
    assert HookConfig.from_env(env={"REBALANCER_TOTAL_STEPS": " 500 "}, global_batch_size=8).total_steps == 500
    cfg = HookConfig.from_env(env={"REBALANCER_TOTAL_STEPS": "500"}, global_batch_size=8, total_steps=7)
    assert cfg.total_steps == 7  # an argument wins over the environment
    with pytest.raises(ValueError, match="REBALANCER_TOTAL_STEPS must be a whole number of steps, got '1e3'"):
        HookConfig.from_env(env={"REBALANCER_TOTAL_STEPS": "1e3"}, global_batch_size=8)
    with pytest.raises(ValueError, match="total_steps must be an integer >= 1"):
        HookConfig(global_batch_size=8, total_steps=0)


def test_set_total_steps_validates() -> None:
    hook = RebalanceHook(global_batch_size=8)
    try:
        hook.set_total_steps(40)
        assert hook.total_steps == 40
        hook.set_total_steps(None)
        assert hook.total_steps is None
        for bad in (0, -3, 2.5, True, "10"):
            with pytest.raises(ValueError, match="total_steps must be an integer >= 1 or None"):
                hook.set_total_steps(bad)  # type: ignore[arg-type]
    finally:
        hook.close()


def _train(hook: RebalanceHook, steps: int) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    loader = torch.utils.data.DataLoader(data, batch_sampler=hook.batch_sampler(data, shuffle=False))
    for done, (x, y) in enumerate(loader):
        if done == steps:
            break
        with hook.step():
            torch.nn.functional.mse_loss(model(x), y).backward()
            time.sleep(0.01)
            opt.step()
            opt.zero_grad()


@pytest.mark.multiproc
def test_the_job_shows_an_eta_from_the_hooks_total(tmp_path: Path) -> None:
    with running_server(tmp_path) as server:
        hook = RebalanceHook(server=server.url, job="eta", global_batch_size=8, total_steps=400,
                             flush_interval_s=0.1)
        try:
            def job() -> Any:
                return server.get("/api/v1/jobs/eta")

            _train(hook, 6)
            got = wait_until(lambda: (j := job()).get("batch_index") == 5 and j, "batch 5 in the job", log=server.log)
            assert got["total_steps"] == 400
            assert got["eta_s"] == pytest.approx(394 * got["step_ms"] / 1000.0)
            hook.set_total_steps(1000)  # the loop learns it runs longer
            _train(hook, 3)
            got = wait_until(lambda: (j := job()).get("batch_index") == 8 and j, "batch 8 in the job", log=server.log)
            assert got["total_steps"] == 1000
            assert got["eta_s"] == pytest.approx(991 * got["step_ms"] / 1000.0)
        finally:
            hook.close()


@pytest.mark.parametrize(
    ("max_steps", "accum", "per_epoch", "want"),
    [
        (20, 1, 5, 20),  # no accumulation: one hook step per optimizer step
        (9, 2, 5, 15),  # windows 2,2,1 per epoch of 5: three epochs
        (4, 2, 5, 7),  # one epoch (5) and one full window of the next
        (10, 4, 8, 40),  # windows 4,4 per epoch of 8: 10 updates are 5 epochs, 40 micro-batches
        (3, 3, 0, 9),  # epoch length unknown: full windows
    ],
)
def test_hf_trainer_total_in_hook_steps(max_steps: int, accum: int, per_epoch: int, want: int) -> None:
    from trainer_hook.integrations.hf_trainer import hook_steps_for

    assert hook_steps_for(max_steps, accum, per_epoch) == want

"""RebalanceHook in one process: offline steps, placements, rejects, attach errors."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from rebalancer_wire.protocol import Error, Placement
from trainer_hook import RebalanceHook, _native_comm_hook
from trainer_hook.gradients import GradientState, register_comm_hook


@pytest.fixture(autouse=True)
def _offline_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("REBALANCER_SERVER", "REBALANCER_JOB", "REBALANCER_TOKEN", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def _data(n: int = 32) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=gen), torch.randn(n, 1, generator=gen))


def _train(hook: RebalanceHook, model: torch.nn.Module, steps: int, on_step=None) -> None:  # type: ignore[no-untyped-def]
    ds = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(ds, batch_sampler=hook.batch_sampler(ds, seed=1))
    while hook.batch_index < steps:
        for x, y in loader:
            if on_step is not None:
                on_step(hook.batch_index)
            with hook.step():
                loss = torch.nn.functional.mse_loss(model(x), y) * hook.loss_weight()
                loss.backward()
                opt.step()
                opt.zero_grad()
            if hook.batch_index >= steps:
                break


def test_offline_hook_times_every_step_and_keeps_history() -> None:
    hook = RebalanceHook(global_batch_size=8)
    model = hook.attach(torch.nn.Linear(4, 1))
    _train(hook, model, 10)
    hook.close()
    assert hook.batch_index == 10 and len(hook.history) == 10
    assert [r.batch_index for r in hook.history] == list(range(10))
    last = hook.last_step
    assert last is not None and last.local_batch_size == 8 and last.placement_version == 0
    assert last.compute_ms > 0 and last.step_ms >= last.compute_ms
    assert not hook.connected and hook.dropped == 0
    assert (hook.rank, hook.world_size, hook.shares) == (0, 1, [8])


def test_request_placement_applies_at_the_announced_batch_and_acks() -> None:
    hook = RebalanceHook(global_batch_size=8, exchange_every=2, exchange_lag=1, lookahead=2)
    model = hook.attach(torch.nn.Linear(4, 1))
    versions = []

    def on_step(k: int) -> None:
        if k == 3:
            assert hook.request_placement([8], reason="again") == 1
        versions.append(hook.schedule.at(k).version)

    _train(hook, model, 10, on_step)
    hook.close()
    # Requested before step 3; the exchange at step 4 announces batch 4 + 1 + 2 = 7.
    assert hook.acks == [(1, 7)]
    assert versions == [0] * 7 + [1] * 3
    assert [r.placement_version for r in hook.history] == versions


def test_invalid_placements_are_rejected_with_reasons_and_training_goes_on() -> None:
    hook = RebalanceHook(global_batch_size=8, exchange_every=2, exchange_lag=1, lookahead=2)
    model = hook.attach(torch.nn.Linear(4, 1))
    raised: list[str] = []

    def on_step(k: int) -> None:
        if k == 2:
            for bad in ([4, 4], [7], [-8]):
                try:
                    hook.request_placement(bad)
                except ValueError as exc:
                    raised.append(str(exc))
            hook._on_message(Placement(job="local", version=5, shares=[9], global_batch_size=8))
            hook._on_message(Placement(job="local", version=6, shares=[16], global_batch_size=16))
            hook._on_message(Error(code="malformed", message="bad frame"))

    _train(hook, model, 8, on_step)
    hook.close()
    assert raised == [
        "placement version 1 is invalid: shares has 2 entries but the job has world_size 1.",
        "placement version 1 is invalid: shares sum to 7 but the global batch size is 8.",
        "placement version 1 is invalid: shares[0] must be >= 0, got -8.",
    ]
    assert [v for v, _ in hook.rejections] == [1, 1, 1, 5, 6]
    assert "global batch size 16" in hook.rejections[-1][1]
    assert hook.last_error is not None and hook.last_error.code == "malformed"
    assert hook.batch_index == 8 and hook.acks == [] and hook.placement_version == 0


def test_a_placement_from_a_replica_that_lost_the_job_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    hook = RebalanceHook(global_batch_size=8, exchange_every=2, exchange_lag=1, lookahead=2)
    model = hook.attach(torch.nn.Linear(4, 1))

    def on_step(k: int) -> None:
        if k == 1:
            hook._on_message(Placement(job="local", version=1, shares=[8], global_batch_size=8, epoch=3))
            # The replica paused past its lease sends its (older) placement late: ignored, no reject.
            hook._on_message(Placement(job="local", version=1, shares=[8], global_batch_size=8, epoch=2))
        if k == 4:  # a newer version under a lower epoch: the backend's store was replaced
            hook._on_message(Placement(job="local", version=2, shares=[8], global_batch_size=8, epoch=1))

    _train(hook, model, 12, on_step)
    hook.close()
    assert hook.rejections == [] and hook.placement_version == 2
    assert "ignored placement version 1 from a backend replica that no longer owns the job (lease epoch 2 < 3)" \
        in caplog.text


def test_request_placement_sets_or_keeps_the_cost_model_k() -> None:
    hook = RebalanceHook(global_batch_size=8, exchange_every=2, exchange_lag=1, lookahead=2)
    model = hook.attach(torch.nn.Linear(4, 1))
    for bad, shown in [(-1, "-1.0"), (float("nan"), "nan"), (2e6, "2000000.0"), ("1", "'1'"), (True, "True")]:
        with pytest.raises(ValueError, match=r"length_sq_weight must be a number in \[0, 1e\+06\] \(k of L \+ "
                                             rf"k\*L\^2\), got {re.escape(shown)}\."):
            hook.request_placement([8], length_sq_weight=bad)  # type: ignore[arg-type]

    def on_step(k: int) -> None:
        if k == 1:
            hook.request_placement([8], length_sq_weight=0.25)  # the same shares, a new k
        if k == 5:
            hook.request_placement([8])  # keeps the k of the newest placement

    _train(hook, model, 12, on_step)
    hook.close()
    assert [(t.version, t.length_sq_weight) for t in hook.schedule.timeline()] == [(0, 0.0), (1, 0.25), (2, 0.25)]


def test_older_or_repeated_versions() -> None:
    hook = RebalanceHook(global_batch_size=4)
    assert hook.request_placement([4], version=3) == 3
    with pytest.raises(ValueError, match="version 2 is not newer than version 3"):
        hook.request_placement([4], version=2)
    hook._on_message(Placement(job="local", version=3, shares=[4], global_batch_size=4))  # duplicate: ignored
    assert [v for v, _ in hook.rejections] == [2]
    hook.close()


def test_attach_errors_are_clear() -> None:
    hook = RebalanceHook(global_batch_size=4)
    with pytest.raises(ValueError, match=r"gradients must be one of \('auto', 'comm_hook', 'loss_scale'\)"):
        hook.attach(torch.nn.Linear(2, 1), gradients="mean")
    hook.attach(torch.nn.Linear(2, 1))
    assert hook.gradients == "local"  # one process: nothing to weight
    with pytest.raises(RuntimeError, match="attach\\(\\) was already called"):
        hook.attach(torch.nn.Linear(2, 1))
    hook.close()
    with pytest.raises(RuntimeError, match="closed"):
        hook.step().__enter__()
    with pytest.raises(ValueError, match="expected a torch.nn.parallel.DistributedDataParallel model, got Linear"):
        register_comm_hook(torch.nn.Linear(2, 1), GradientState())


def test_world_size_without_process_group_says_what_to_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 10: the hook may be created before the HF TrainingArguments / Accelerator
    # (which start the process group); using it before then says what to create first.
    monkeypatch.setenv("WORLD_SIZE", "4")
    hook = RebalanceHook(global_batch_size=8)
    assert hook.lookahead is None
    for use in (lambda: hook.world_size, lambda: hook.attach(torch.nn.Linear(2, 1)),
                lambda: hook.batch_sampler(8), lambda: hook.step().__enter__()):
        with pytest.raises(RuntimeError, match="WORLD_SIZE is 4.*init_process_group.*TrainingArguments.*Accelerator"):
            use()
    hook.close()


def test_bad_global_batch_size_is_refused(one_rank_group: None) -> None:
    with pytest.raises(ValueError, match="global_batch_size must be an integer >= 1, got 0"):
        RebalanceHook(global_batch_size=0)


def test_ddp_with_a_comm_hook_already_is_refused(one_rank_group: None) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = DDP(torch.nn.Linear(4, 1))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    hook = RebalanceHook(global_batch_size=8)
    with pytest.raises(RuntimeError, match="already has a communication hook registered"):
        hook.attach(model)
    hook.close()


def test_accumulation_without_no_sync_is_reported(one_rank_group: None) -> None:
    hook = RebalanceHook(global_batch_size=8)
    model = hook.attach(DDP(torch.nn.Linear(4, 1)))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with pytest.raises(RuntimeError, match=r"more than once in one hook.step\(\).*no_sync"):
        with hook.step():
            for part in (slice(0, 4), slice(4, 8)):
                torch.nn.functional.mse_loss(model(x[part]), y[part]).backward()
    with hook.step():  # the right way: no_sync for all micro-batches but the last
        with model.no_sync():
            (torch.nn.functional.mse_loss(model(x[:4]), y[:4]) / 2).backward()
        (torch.nn.functional.mse_loss(model(x[4:]), y[4:]) / 2).backward()
    rec = hook.last_step
    assert rec is not None and rec.batch_index == 1
    hook.close()


def _one_ddp_step_like_a_plain_model() -> RebalanceHook:
    """A one-rank DDP Linear under the hook: one step, whose gradients must equal those of
    the same model without DDP or hook; returns the (open) hook."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 1)
    model = DDP(torch.nn.Linear(4, 1))
    model.module.load_state_dict(plain.state_dict())
    hook = RebalanceHook(global_batch_size=8)
    hook.attach(model)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with hook.step():
        torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.functional.mse_loss(plain(x), y).backward()
    for a, b in zip(model.module.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    assert hook._grads.last_bucket_t is not None and hook._grads.last_done_t is not None
    return hook


def test_ddp_comm_hook_weights_and_times_buckets(one_rank_group: None) -> None:
    hook = _one_ddp_step_like_a_plain_model()
    rec = hook.last_step
    assert rec is not None and rec.compute_ms > 0 and rec.sync_wait_ms >= 0
    hook.close()


@pytest.mark.multiproc  # the failed build runs the compiler
def test_ddp_falls_back_to_the_python_comm_hook_where_the_cpp_one_cannot_be_built(
    one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No working compiler (CXX names one that fails) and an empty extensions cache: the
    # build fails, attach() registers the Python hook, and the step is the same.
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(_native_comm_hook, "_loaded", [])  # this process has not tried yet
    assert _native_comm_hook.load() is None
    hook = _one_ddp_step_like_a_plain_model()
    assert hook.gradients == "ddp_comm_hook" and not hook._grads.native
    hook.close()


@pytest.mark.timeout(60)
def test_a_build_lock_left_by_an_interrupted_build_falls_back_instead_of_waiting_forever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's build lock has no timeout: a first build killed half-way (Ctrl-C at the
    # first attach()) left every later process waiting on it for ever.
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(_native_comm_hook, "_loaded", [])
    lock = Path(_get_build_directory(_native_comm_hook._name(), False)) / "lock"
    lock.touch()
    old = lock.stat().st_mtime - _native_comm_hook.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert _native_comm_hook.load() is None
    assert lock.exists(), "another process's lock is not ours to remove"


class _AskedInWorker(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> bool:
        return _native_comm_hook.load() is None


@pytest.mark.multiproc  # a DataLoader worker process
def test_the_cpp_comm_hook_is_never_built_or_loaded_in_a_dataloader_worker() -> None:
    # A spawned worker: a fresh interpreter with nothing loaded (a worker forked from this
    # test process, which has run threads of every kind by now, once died of SIGSEGV in CI).
    loader = DataLoader(_AskedInWorker(), batch_size=None, num_workers=1, multiprocessing_context="spawn")
    (in_worker,) = loader
    assert in_worker is True


@pytest.mark.multiproc  # builds the extension where the cache lacks it
@pytest.mark.parametrize("native", [True, False], ids=["cpp_comm_hook", "python_comm_hook"])
def test_both_ddp_comm_hooks_weight_buckets_bit_for_bit_alike(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    # float64, one bucket per parameter, a new weight every step: the reduced gradients
    # equal weight * the local gradients exactly (one rank: the SUM is the rank's own).
    monkeypatch.setenv(_native_comm_hook.ENV_VAR, "1" if native else "0")
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double()
    model = DDP(copy.deepcopy(plain), bucket_cap_mb=1e-6)
    hook = RebalanceHook(global_batch_size=8)
    hook.attach(model)
    assert hook._grads.native is native
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    for weight in (1 / 3, 0.7, 1e-3):
        with hook.step():
            hook._grads.weight = weight  # as a placement of weight * B samples would set it
            torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.functional.mse_loss(plain(x), y).backward()
        for a, b in zip(model.module.parameters(), plain.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert torch.equal(a.grad, b.grad.mul_(weight))
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    hook.close()


def test_state_dict_round_trip_and_bad_states_are_refused() -> None:
    hook = RebalanceHook(global_batch_size=8, exchange_every=2, exchange_lag=1)
    model = hook.attach(torch.nn.Linear(4, 1))

    def on_step(k: int) -> None:
        if k == 1:
            hook.request_placement([8], reason="r")

    _train(hook, model, 7, on_step)
    sd = hook.state_dict()
    hook.close()
    assert sd == {
        "format": 1, "batch_index": 7, "global_batch_size": 8, "world_size": 1,
        "placement": {"version": 1, "shares": [8]}, "next_placement": None, "epoch": 1, "batches_per_epoch": 4,
    }
    again = RebalanceHook(global_batch_size=8)
    again.attach(torch.nn.Linear(4, 1))
    for bad, match in [
        ({**sd, "global_batch_size": 16}, "global_batch_size 16"),
        ({**sd, "batch_index": -1}, "batch_index must be"),
        ({**sd, "placement": {"version": 1, "shares": [9]}}, "sum to 9"),
        ({"batch_index": 3}, "not a RebalanceHook state_dict"),
    ]:
        with pytest.raises(ValueError, match=match):
            again.load_state_dict(bad)
    again.load_state_dict(sd)
    assert (again.batch_index, again.placement_version) == (7, 1)
    _train(again, torch.nn.Linear(4, 1), 9)
    assert again.acks == [(1, 7)] and again.batch_index == 9
    with pytest.raises(RuntimeError, match="before the first batch is drawn"):
        again.load_state_dict(sd)
    again.close()

"""Issue 10: any DataLoader configuration works with the default HookConfig (one process)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from trainer_hook import RebalanceHook

# 2 cores here: DataLoader warns about 4 workers, which is what these tests are about.
pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning"),
]


@pytest.fixture(autouse=True)
def _offline_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("REBALANCER_SERVER", "REBALANCER_JOB", "REBALANCER_TOKEN", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def _indexed(n: int = 64) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _consume(hook: RebalanceHook, loader: DataLoader, steps: int, plan: dict[int, list[int]] | None = None) -> list[list[int]]:  # type: ignore[type-arg]
    seen: list[list[int]] = []
    sampler = loader.batch_sampler
    while hook.batch_index < steps:
        for (idx,) in loader:
            k = hook.batch_index
            if plan and k in plan:
                hook.request_placement(plan[k])
            with hook.step():
                lo, hi = sampler.local_bounds(k)  # type: ignore[union-attr]
                assert idx.tolist() == sampler.global_batch(k)[lo:hi]  # type: ignore[union-attr]
                seen.append(idx.tolist())
            if hook.batch_index >= steps:
                break
    return seen


@pytest.mark.parametrize(("workers", "prefetch", "expected"), [(0, None, 1), (2, None, 5), (4, None, 9), (8, None, 17), (2, 3, 7)])
def test_the_default_lookahead_is_measured_from_the_loader(workers: int, prefetch: int | None, expected: int) -> None:
    # Reported: DataLoader(batch_sampler=hook.batch_sampler(ds), num_workers=4) crashed at
    # batch 10 with "The placement for batch 10 is not settled yet" (lookahead was 8).
    hook = RebalanceHook(global_batch_size=4)
    ds = _indexed(256)  # 64 batches an epoch: more than 8 workers fetch ahead (a loader stops at its epoch's end)
    extra = {} if prefetch is None else {"prefetch_factor": prefetch}
    loader = DataLoader(ds, batch_sampler=hook.batch_sampler(ds, seed=2), num_workers=workers, **extra)
    assert hook.lookahead is None  # not measured before the first step
    _consume(hook, loader, 24)
    hook.close()
    assert hook.lookahead == expected


def test_an_explicit_lookahead_wins() -> None:
    hook = RebalanceHook(global_batch_size=4, lookahead=12)
    assert hook.lookahead == 12
    ds = _indexed()
    _consume(hook, DataLoader(ds, batch_sampler=hook.batch_sampler(ds)), 3)
    hook.close()
    assert hook.lookahead == 12


def test_hook_data_loader_knows_its_depth_and_takes_set_epoch() -> None:
    hook = RebalanceHook(global_batch_size=4)
    ds = _indexed(40)
    loader = hook.data_loader(ds, seed=1, num_workers=2, prefetch_factor=3, persistent_workers=True)
    assert hook.lookahead == 7  # known before the first step: 2 workers * 3 + 1
    for epoch in range(3):  # the DDP tutorial's epoch loop
        loader.sampler.set_epoch(epoch)
        loader.batch_sampler.set_epoch(epoch)
        for (_idx,) in loader:
            with hook.step():
                pass
    hook.close()
    assert hook.batch_index == 30 and len(loader) == 10 and len(loader.sampler) == 40


def test_placements_change_under_a_measured_lookahead_with_workers() -> None:
    hook = RebalanceHook(global_batch_size=4)
    ds = _indexed()
    loader = DataLoader(ds, batch_sampler=hook.batch_sampler(ds, seed=3), num_workers=2, pin_memory=True)
    _consume(hook, loader, 30, plan={1: [4], 9: [4]})
    hook.close()
    # Requested at step 1, carried by the exchange at step 4: 4 + lag 2 + lookahead 5.
    assert [v for v, _ in hook.acks] == [1, 2]
    assert hook.acks[0][1] == 4 + 2 + 5


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from range(8)

    def __len__(self) -> int:
        return 8


def test_iterable_datasets_and_foreign_batch_sizes_are_refused() -> None:
    hook = RebalanceHook(global_batch_size=4)
    with pytest.raises(ValueError, match="IterableDataset.*map-style"):
        hook.batch_sampler(_Stream())
    with pytest.raises(ValueError, match="IterableDataset.*map-style"):
        hook.data_loader(_Stream())
    with pytest.raises(ValueError, match="batch_size=8.*global_batch_size.*4"):
        hook.data_loader(_indexed(), batch_size=8)
    with pytest.raises(ValueError, match="batch_sampler"):
        hook.data_loader(_indexed(), batch_sampler=[[0]])
    hook.close()


def test_a_run_resumed_near_an_epoch_end_measures_again_at_the_next_epoch() -> None:
    # The loader can only run ahead to the end of its epoch: resumed 2 batches before it,
    # the first step sees the sampler 1 batch ahead, which says nothing about the next
    # epoch's prefetch (2 workers x 2). The hook measures again when that epoch starts.
    hook = RebalanceHook(global_batch_size=4)
    ds = _indexed()  # 16 batches an epoch
    loader = DataLoader(ds, batch_sampler=hook.batch_sampler(ds, seed=2), num_workers=2)
    hook.load_state_dict({
        "format": 1, "batch_index": 14, "global_batch_size": 4, "world_size": 1,
        "placement": {"version": 3, "shares": [4]}, "next_placement": None,
    })
    _consume(hook, loader, 36, plan={15: [4]})
    hook.close()
    assert hook.lookahead == 5
    # Requested at step 15; no exchange before the agreement at 16, whose exchange
    # announces it for 16 + lag 2 + 5.
    assert hook.acks == [(3, 14), (4, 23)]

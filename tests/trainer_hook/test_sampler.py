"""RebalanceBatchSampler: one global order, contiguous slices, placements by batch index."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from trainer_hook.placement import PlacementSchedule
from trainer_hook.sampler import RebalanceBatchSampler


def samplers(n: int, schedule: PlacementSchedule, **kw: object) -> list[RebalanceBatchSampler]:
    return [RebalanceBatchSampler(n, schedule=schedule, rank=r, **kw) for r in range(schedule.world_size)]  # type: ignore[arg-type]


def test_rank_slices_are_contiguous_pieces_of_the_same_global_batch() -> None:
    sched = PlacementSchedule(3, 10)
    sched.add(2, 1, [1, 2, 7])
    ss = samplers(50, sched, seed=5)
    for k in range(4):
        whole = ss[0].global_batch(k)
        pieces = [s.local_batch(k)[0] for s in ss]
        assert sum(pieces, []) == whole
        assert [len(p) for p in pieces] == ([4, 3, 3] if k < 2 else [1, 2, 7])


def test_global_order_is_seeded_per_epoch_and_identity_without_shuffle() -> None:
    sched = PlacementSchedule(1, 4)
    a, b = RebalanceBatchSampler(12, schedule=sched, rank=0, seed=1), RebalanceBatchSampler(12, schedule=sched, rank=0, seed=1)
    assert a.global_order(0) == b.global_order(0)
    assert a.global_order(0) != a.global_order(1)
    assert sorted(a.global_order(1)) == list(range(12))
    plain = RebalanceBatchSampler(12, schedule=sched, rank=0, shuffle=False)
    assert [plain.global_batch(k) for k in (0, 2, 3)] == [[0, 1, 2, 3], [8, 9, 10, 11], [0, 1, 2, 3]]


def test_len_and_drop_last() -> None:
    sched = PlacementSchedule(2, 4)
    assert len(RebalanceBatchSampler(10, schedule=sched, rank=0)) == 3
    assert len(RebalanceBatchSampler(10, schedule=sched, rank=0, drop_last=True)) == 2
    with pytest.raises(ValueError, match="fewer than one global batch of 4 with drop_last=True"):
        RebalanceBatchSampler(3, schedule=sched, rank=0, drop_last=True)


def test_short_last_batch_is_split_in_proportion_and_weights_sum_to_one() -> None:
    sched = PlacementSchedule(3, 8, shares=[1, 2, 5])
    ss = samplers(10, sched, shuffle=False)
    assert ss[0].batch_length(1) == 2
    pieces = [s.local_batch(1) for s in ss]
    real = [p for p, dummy in pieces if not dummy]
    assert sorted(sum(real, [])) == [8, 9]
    assert sum(s.weight(1) for s in ss) == pytest.approx(1.0)
    assert pieces[0] == ([8], True)  # 1/8 of 2 samples rounds to none: a dummy


def test_drained_rank_gets_a_one_sample_dummy_with_weight_zero() -> None:
    sched = PlacementSchedule(3, 6, shares=[3, 0, 3])
    ss = samplers(12, sched, shuffle=False)
    assert ss[1].local_batch(0) == ([0], True)
    assert ss[1].weight(0) == 0.0
    assert ss[0].weight(0) == ss[2].weight(0) == 0.5


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 60),
    data=st.data(),
)
def test_every_sample_of_every_batch_is_used_exactly_once(n: int, data: st.DataObject) -> None:
    world = data.draw(st.integers(1, 4))
    b = data.draw(st.integers(world, 16))
    cuts = sorted(data.draw(st.lists(st.integers(0, b), min_size=world - 1, max_size=world - 1)))
    shares = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, b], strict=True)]
    if not any(shares):
        shares[0] = b
    sched = PlacementSchedule(world, b, shares=shares)
    drop_last = data.draw(st.booleans()) and n >= b
    ss = samplers(n, sched, seed=data.draw(st.integers(0, 9)), drop_last=drop_last)
    for k in range(2 * len(ss[0])):
        used: Counter[int] = Counter()
        for s in ss:
            idx, dummy = s.local_batch(k)
            assert idx, "never an empty batch"
            if not dummy:
                used.update(idx)
        assert used == Counter(ss[0].global_batch(k))
        assert sum(s.weight(k) for s in ss) == pytest.approx(1.0)


def test_iteration_starts_at_the_training_position_and_ends_with_the_epoch() -> None:
    sched = PlacementSchedule(1, 3)
    pos = {"k": 0}
    s = RebalanceBatchSampler(9, schedule=sched, rank=0, shuffle=False, position=lambda: pos["k"])
    assert list(s) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    pos["k"] = 4  # the loop broke out after batch 3 (epoch 1, second batch next)
    assert list(s) == [[3, 4, 5], [6, 7, 8]]
    standalone = RebalanceBatchSampler(9, schedule=sched, rank=0, shuffle=False)
    first = list(standalone)
    assert first == list(standalone), "each full pass is one epoch"


def test_iterable_dataset_is_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="iterable datasets cannot be split"):
        RebalanceBatchSampler(iter(range(3)), schedule=PlacementSchedule(1, 2), rank=0)  # type: ignore[arg-type]


class Indexed(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 80

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_workers_follow_the_batch_index_not_the_arrival_time(num_workers: int) -> None:
    sched = PlacementSchedule(2, 8)
    sched.add(3, 1, [2, 6])
    sched.settle(5)  # what a control exchange guarantees: batches up to 5 are final
    s = RebalanceBatchSampler(Indexed(), schedule=sched, rank=1, seed=4)
    loader = DataLoader(Indexed(), batch_sampler=s, num_workers=num_workers)
    got = []
    for k, batch in enumerate(loader):
        if k == 1:
            # Workers may hold batches up to 5 by now; the new placement starts at 6
            # whatever they hold, and a start inside the settled range is refused.
            with pytest.raises(ValueError, match="batches up to 5 are settled"):
                sched.add(5, 2, [5, 3])
            sched.add(6, 2, [5, 3])
            sched.settle(20)
        got.append(batch.tolist())
    want = [s.local_batch(k)[0] for k in range(10)]
    assert got == want
    assert [len(g) for g in got] == [4, 4, 4, 6, 6, 6, 3, 3, 3, 3]
    assert got[6] == s.global_batch(6)[5:8]


def test_prefetch_beyond_the_settled_horizon_raises_through_the_loader() -> None:
    sched = PlacementSchedule(1, 2, settled_until=1)
    loader = DataLoader(Indexed(), batch_sampler=RebalanceBatchSampler(Indexed(), schedule=sched, rank=0))
    it = iter(loader)
    next(it), next(it)
    with pytest.raises(RuntimeError, match="not settled yet"):
        next(it)
    assert torch.get_num_threads() >= 1


def test_the_samples_fingerprint_tells_apart_ranks_that_would_train_different_samples() -> None:
    # The members of a mesh replica compare it (trainer_hook/mesh.py): equal for the same
    # samples, different for another seed, rank, batch or placement; a drained rank's dummy
    # batch too.
    def sampler(seed: int = 1, rank: int = 0, shares: list[int] | None = None,
                cost: list[float] | None = None) -> RebalanceBatchSampler:
        schedule = PlacementSchedule(2, 16)
        if shares is not None:
            schedule.add(0, 1, shares)
        return RebalanceBatchSampler(100, schedule=schedule, rank=rank, shuffle=True, seed=seed, sample_cost=cost)

    a = sampler()
    assert [a.samples_fingerprint(k) for k in range(9)] == [sampler().samples_fingerprint(k) for k in range(9)]
    assert a.samples_fingerprint(3) != sampler(seed=2).samples_fingerprint(3)
    assert a.samples_fingerprint(3) != sampler(rank=1).samples_fingerprint(3)
    assert a.samples_fingerprint(3) != a.samples_fingerprint(4)
    assert a.samples_fingerprint(3) != sampler(shares=[10, 6]).samples_fingerprint(3)
    assert sampler(shares=[0, 16]).samples_fingerprint(6) == sampler(shares=[0, 16]).samples_fingerprint(6)
    cost = [float(i % 7 + 1) for i in range(100)]  # with a cost: positions, not one slice
    assert sampler(cost=cost).samples_fingerprint(2) == sampler(cost=cost).samples_fingerprint(2)
    assert sampler(cost=cost).samples_fingerprint(2) != sampler(cost=cost, seed=5).samples_fingerprint(2)

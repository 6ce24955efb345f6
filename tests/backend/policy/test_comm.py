"""``backend.policy.comm``: bus bandwidth, transfer and wait per step, and the verdict."""

from __future__ import annotations

import pytest

from backend.policy.comm import CommStep, assess, bandwidth_gbps, bus_factor


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_reduce", 1) == 0.0
    assert bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    alg, bus = bandwidth_gbps(1e9, 500.0, "all_reduce", 2)  # type: ignore[misc]
    assert (alg, bus) == (pytest.approx(2.0), pytest.approx(2.0))
    assert bandwidth_gbps(1e9, 0.0, "all_reduce", 2) is None


@pytest.mark.parametrize(("call", "message"), [
    (lambda: bus_factor("broadcast", 4), "kind must be one of all_reduce, reduce_scatter, all_gather, got 'broadcast'."),
    (lambda: bus_factor("all_reduce", 0), "world_size must be an integer >= 1, got 0."),
    (lambda: bandwidth_gbps(-1.0, 1.0, "all_reduce", 2), "nbytes must be a finite number >= 0, got -1.0."),
    (lambda: assess("ring", 2, {}), "kind must be one of all_reduce, reduce_scatter, all_gather or empty, got 'ring'."),
    (lambda: assess("", 2, {}, window=0), "window must be an integer >= 1, got 0."),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError) as exc:
        call()
    assert str(exc.value) == message


def _job(compute, *, transfer=10.0, overlap=2.0, data=0.0, nbytes=4_000_000, steps=5, timed=True):
    """Ranks whose compute differs: each waits for the slowest, then ``transfer`` ms of
    all-reduce of which ``overlap`` is hidden behind its own compute."""
    slowest = max(compute)
    out = {}
    for r, c in enumerate(compute):
        wait = slowest - c
        exposed = transfer - overlap + wait
        step = data + c + exposed + 1.0
        out[r] = [CommStep(k, c, exposed, data, step, nbytes if timed else None,
                           transfer + wait if timed else None) for k in range(steps)]
    return out


def test_transfer_is_the_last_arrivers_and_the_rest_is_waiting():
    c = assess("all_reduce", 4, _job([10.0, 10.0, 30.0, 20.0]))
    assert c.transfer_ms == pytest.approx(10.0)
    assert c.exposed_comm_ms == pytest.approx(8.0)  # the last arriver's: transfer less overlap
    assert [r.wait_ms for r in c.ranks] == [pytest.approx(w) for w in (20.0, 20.0, 0.0, 10.0)]
    assert [r.comm_ms for r in c.ranks] == [pytest.approx(w) for w in (30.0, 30.0, 10.0, 20.0)]
    # 4 MB in 10 ms: algbw 0.4 GB/s; busbw x 2(n-1)/n = 1.5
    assert c.algbw_gbps == pytest.approx(0.4) and c.busbw_gbps == pytest.approx(0.6)
    assert all(r.busbw_gbps == pytest.approx(0.6) for r in c.ranks)
    assert c.bytes_per_step == 4_000_000 and c.n_steps == 5
    assert c.step_ms == pytest.approx(39.0) and c.compute_ms == 30.0
    assert c.bound == "compute-bound" and c.compute_share == pytest.approx(30 / 39)
    assert c.detail == ("compute-bound: 39 ms step; compute 77%; 21% of the step is exposed all-reduce "
                        "at 0.6 GB/s busbw; data wait 0%")


def test_verdicts():
    assert assess("all_reduce", 2, _job([5.0, 6.0], transfer=30.0, overlap=1.0)).bound == "communication-bound"
    assert assess("all_reduce", 2, _job([5.0, 6.0], data=20.0)).bound == "input-bound"
    assert assess("all_reduce", 2, _job([12.0, 12.0], transfer=12.0, overlap=0.0)).bound == "balanced"
    empty = assess("all_reduce", 2, {0: [], 1: []})
    assert empty.bound == "unknown" and empty.n_steps == 0 and empty.busbw_gbps is None
    assert [r.wait_ms for r in empty.ranks] == [None, None]


def test_absent_counters_are_none_never_zero():
    c = assess("all_reduce", 2, _job([5.0, 9.0], timed=False))
    assert (c.bytes_per_step, c.transfer_ms, c.busbw_gbps, c.algbw_gbps) == (None, None, None, None)
    assert all((r.comm_bytes_per_step, r.comm_ms, r.wait_ms, r.busbw_gbps) == (None,) * 4 for r in c.ranks)
    # The split of the step needs no counters: the exposed part is the last arriver's sync wait.
    assert c.exposed_comm_ms == pytest.approx(8.0) and c.comm_share == pytest.approx(8 / 18)
    unknown_kind = assess("", 2, _job([5.0, 9.0]))
    assert unknown_kind.bytes_per_step == 4_000_000 and unknown_kind.busbw_gbps is None


def test_only_steps_every_rank_reported_count_newest_window():
    steps = _job([10.0, 20.0], steps=30)
    steps[0] = steps[0][:25]  # rank 0's newest 5 not in yet
    c = assess("all_reduce", 2, steps, window=10)
    assert c.n_steps == 10

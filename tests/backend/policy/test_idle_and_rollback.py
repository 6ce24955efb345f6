"""A rank drained to share 0 by the policy, and a rolled-back change (issue 13's defect).

`rebalancer demo --ranks 3 --speeds 1,1,0.01 --mode auto`: auto mode drains the very slow
rank; once its measured steps leave the window the policy assumed the median speed for it,
proposed giving it work back, the placement was rolled back, and a nearly identical split
was proposed again (only exact repeats were blocked).
"""

from __future__ import annotations

from backend.policy import (
    JobObservation,
    NoProposal,
    PolicyConfig,
    Proposal,
    RankObservation,
    Rollback,
    StepSample,
    decide,
)


def _rank(i: int, rows: list[tuple[int, int, float]]) -> RankObservation:
    return RankObservation(rank=i, steps=tuple(StepSample(k, b, t) for k, b, t in rows))


def _job(ranks: list[RankObservation], shares: tuple[int, ...], *, batch_index: int,
         version: int = 3, since: int = 100, rollbacks: tuple[Rollback, ...] = ()) -> JobObservation:
    return JobObservation(job="demo", world_size=len(ranks), global_batch_size=sum(shares),
                          batch_index=batch_index, shares=shares, placement_version=version,
                          steps_since_change=since, ranks=tuple(ranks), rollbacks=rollbacks)


def _steady(b: int, ms_per_sample: float, start: int, n: int, fixed_ms: float = 1.0):
    return [(k, b, fixed_ms + ms_per_sample * b) for k in range(start, start + n)]


def test_an_idle_rank_without_steps_in_the_window_gets_no_work_back():
    # Rank 2 was drained 100 steps ago: every step in the window ran it with no samples.
    fast = [_rank(i, _steady(32, 0.05, 100, 100)) for i in range(2)]
    idle = _rank(2, [(k, 0, 0.2) for k in range(100, 200)])
    got = decide(_job([*fast, idle], (32, 32, 0), batch_index=199), PolicyConfig())
    assert isinstance(got, NoProposal), got
    assert got.status == "balanced"
    assert got.explanation is not None
    assert got.explanation.evidence["idle_without_evidence"] == [2]


def test_an_idle_rank_keeps_its_last_measured_cost():
    # Its last measured steps (long ago, at 2 samples) say it is 100x slower: the policy
    # uses them, not the median, and still gives it nothing.
    fast = [_rank(i, _steady(32, 0.05, 100, 100)) for i in range(2)]
    idle = _rank(2, _steady(2, 5.0, 0, 20) + [(k, 0, 0.2) for k in range(100, 200)])
    got = decide(_job([*fast, idle], (32, 32, 0), batch_index=199), PolicyConfig())
    assert isinstance(got, NoProposal) and got.status == "balanced", got
    assert got.explanation is not None
    assert got.explanation.ranks[2].n_steps == 20
    assert got.explanation.ranks[2].c_ms > 10 * got.explanation.ranks[0].c_ms


def test_a_rolled_back_direction_is_not_retried_while_the_rank_costs_the_same():
    # Rank 2 measured 1.6x slower per sample; giving it work back (12 -> 20) was rolled
    # back at step 150. Its cost has not changed since: no proposal that raises its share.
    rb = Rollback(batch_index=150, shares_before=(26, 26, 12), shares_after=(22, 22, 20))
    a = [_rank(i, _steady(26, 1.0, 100, 100)) for i in range(2)]
    slow = _rank(2, _steady(12, 1.0, 100, 100))  # cheap now at 12: the model says "more"
    obs = _job([*a, slow], (26, 26, 12), batch_index=199, rollbacks=(rb,))
    got = decide(obs, PolicyConfig())
    if isinstance(got, Proposal):
        assert got.shares[2] <= 12, got
    else:
        assert got.status in ("balanced", "insufficient_gain"), got
    # Without the record the same observation proposes giving rank 2 more work.
    free = decide(_job([*a, slow], (26, 26, 12), batch_index=199), PolicyConfig())
    assert isinstance(free, Proposal) and free.shares[2] > 12


def test_a_rolled_back_direction_is_open_again_once_the_rank_cost_changed():
    rb = Rollback(batch_index=150, shares_before=(26, 26, 12), shares_after=(22, 22, 20))
    a = [_rank(i, _steady(26, 1.0, 100, 100)) for i in range(2)]
    # Rank 2 got 2x faster per sample after the rollback (its steps since say so).
    slow = _rank(2, _steady(12, 2.0, 100, 51) + _steady(12, 1.0, 151, 49))
    got = decide(_job([*a, slow], (26, 26, 12), batch_index=199, rollbacks=(rb,)), PolicyConfig())
    assert isinstance(got, Proposal) and got.shares[2] > 12, got

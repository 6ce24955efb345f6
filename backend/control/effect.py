"""Measured effect of a placement, and the auto-rollback decision.

When every rank has acked a placement, the step time over the window before its batch
index is on record; once the job has trained ``effect_window_steps`` batches past it (after
a short settle), the window after is measured. An auto-applied change that made steps
slower by more than the rollback threshold goes back. These functions only read
``LiveState`` and return data; the controller records and acts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backend.control.inputs import median

__all__ = [
    "SETTLE_STEPS", "Effect", "window_step_ms", "before_window", "after_window", "judge_effect",
    "speed_factor", "work_factor",
    "merge_acks", "first_batches_under", "effect_record",
]

# The first steps after a switch pay one-off costs (new shapes, caches): not measured.
SETTLE_STEPS = 2


@dataclass(frozen=True, slots=True)
class Effect:
    """What a measurement says: the gain (None without a before) and, when the change
    must go back, why."""

    step_ms_after: float
    measured_gain: float | None
    rollback_reason: str | None


def window_step_ms(live: Any, job: str, *, lo: int, hi: int, need: int = 1) -> float | None:
    """Mean over batch indices lo..hi of the median step time across ranks."""
    if live is None or hi < lo:
        return None
    by_index: dict[int, list[float]] = {}
    for _rank, rec in live.steps(job, batch_from=max(0, lo), batch_to=hi):
        by_index.setdefault(rec.batch_index, []).append(rec.step_ms)
    if len(by_index) < need:
        return None
    return sum(median(v) for v in by_index.values()) / len(by_index)


def before_window(effective: int, window_steps: int) -> tuple[int, int]:
    """Batch indices (lo, hi) measured before a placement that took effect at ``effective``."""
    return effective - window_steps, effective - 1


def after_window(effective: int, window_steps: int) -> tuple[int, int]:
    """Batch indices (lo, hi) measured after it, past the settle steps."""
    lo = effective + SETTLE_STEPS
    return lo, lo + window_steps - 1


def judge_effect(*, version: int, step_ms_before: float | None, step_ms_after: float,
                 rollback_threshold: float, may_roll_back: bool,
                 speed_factor: float = 1.0) -> Effect:
    """The gain of a placement, and whether it goes back: only when ``may_roll_back`` (an
    auto change in auto mode with shares to return to) and it is slower beyond the threshold
    than the old split would have been. ``speed_factor`` (see :func:`speed_factor`, times
    :func:`work_factor` with a per-sample cost) is how much slower the old split got on its
    own meanwhile: a card that kept slowing down while a change answered it, or batches
    that drew longer samples, do not make the change look bad."""
    before, after = step_ms_before, step_ms_after
    gain = (before - after) / before if before else None
    expected = before * speed_factor if before is not None else None
    worse = expected is not None and after > expected * (1 + rollback_threshold)
    reason = None
    if worse and may_roll_back:
        assert before is not None
        scaled = (f" (the old split would have taken {expected:.1f} ms at the speeds and batch work "
                  f"measured since)") if abs(speed_factor - 1.0) >= 0.005 else ""
        reason = (f"measured step time rose from {before:.1f} ms to {after:.1f} ms "
                  f"after version {version}{scaled}; rolling back")
    return Effect(step_ms_after=after, measured_gain=gain, rollback_reason=reason)


# Per-sample cost also moves with the batch size (fixed costs spread thinner or thicker):
# a rank counts as having changed speed only past this.
_SPEED_CHANGE = 0.2


def speed_factor(live: Any, job: str, *, shares: Sequence[int], before: tuple[int, int],
                 after: tuple[int, int]) -> float:
    """How much slower ``shares`` (the split before a change) would have run in the window
    ``after`` than in the window ``before``, from each rank's median time per sample in
    each (ranks idle in either window, or changed by less than 20%, count as unchanged).
    With a per-sample cost, per unit of the rank's work instead: which samples a rank
    draws (long or short) is data, not speed, and a cost split changes the count a rank
    trains with every batch. 1.0 without data; clipped to [0.5, 4]."""
    if live is None:
        return 1.0
    per: dict[int, tuple[list[float], list[float]]] = {}
    works: dict[int, dict[int, Any]] = {}
    for rank, rec in live.steps(job, batch_from=max(0, before[0]), batch_to=after[1]):
        b = rec.local_batch_size
        if b <= 0 or not rec.compute_ms > 0:
            continue
        k = rec.batch_index
        if rank not in works:
            works[rank] = live.work_by_batch(job, rank)
        w = works[rank].get(k)
        if w is not None:
            if not w[0] > 0:
                continue
            b = w[0]
        side = 0 if before[0] <= k <= before[1] else 1 if after[0] <= k <= after[1] else -1
        if side >= 0:
            per.setdefault(rank, ([], []))[side].append(rec.compute_ms / b)
    old = new = 0.0
    for rank, share in enumerate(shares):
        got = per.get(rank)
        if share <= 0 or got is None or not got[0]:
            continue
        c0 = median(got[0])
        ratio = median(got[1]) / c0 if got[1] and c0 > 0 else 1.0
        if abs(ratio - 1.0) < _SPEED_CHANGE:
            ratio = 1.0
        old = max(old, c0 * share)
        new = max(new, c0 * ratio * share)
    if old <= 0:
        return 1.0
    return min(max(new / old, 0.5), 4.0)


def work_factor(live: Any, job: str, *, world_size: int, before: tuple[int, int], after: tuple[int, int],
                length_sq_weight: float = 0.0) -> float:
    """How much more work the global batches of the window ``after`` held than those of
    ``before`` (their mean, ``sum(L) + k*sum(L^2)`` with lengths and a cost model k): with
    variable-length samples a step's time follows its batch's work, which is data, not the
    split, so the old split would have been that much slower (or faster) on the later
    batches. Counting the fixed part of a step as if it grew too errs towards keeping a
    change. 1.0 without a cost; clipped to [0.25, 4]."""
    if live is None:
        return 1.0
    for rank in range(world_size):  # the batch's work is the same on every rank that reports it
        rows = live.work_by_batch(job, rank)
        if rows:
            break
    else:
        return 1.0

    def batch_work(v: Any) -> float:
        return float(v[1] + length_sq_weight * v[3]) if length_sq_weight > 0 and v[3] is not None else float(v[1])

    was = [batch_work(v) for k, v in rows.items() if before[0] <= k <= before[1]]
    now = [batch_work(v) for k, v in rows.items() if after[0] <= k <= after[1]]
    if not was or not now or sum(was) <= 0:
        return 1.0
    return min(max((sum(now) / len(now)) / (sum(was) / len(was)), 0.25), 4.0)


def merge_acks(acks: Mapping[str, int] | None, new: Mapping[int, int]) -> dict[str, int]:
    """Acks on record plus ``new`` (rank -> batch index). The first ack is the switch; a
    restarted rank acking again must not rewrite it."""
    out = dict(acks or {})
    for rank, k in new.items():
        out.setdefault(str(rank), k)
    return out


def first_batches_under(live: Any, job: str, world_size: int, version: int) -> dict[int, int] | None:
    """Each rank's first batch index trained under ``version``, from its steps in memory;
    None until every rank shows it (or when the switch fell out of the buffers)."""
    view = live.view(job)
    if view is None or len(view.ranks) < world_size or any(
            r.placement_version is None or r.placement_version < version for r in view.ranks):
        return None
    first: dict[int, int] = {}
    for rank, rec in live.steps(job):
        if rec.placement_version == version and rank not in first:
            first[rank] = rec.batch_index
    return first if len(first) >= world_size else None


def effect_record(row: Any) -> dict[str, Any]:
    """A placement row's effect, as the job resource's ``last_effect``."""
    return {"version": row.version, **row.public()["effect"]}

"""Measured effect of a placement, and the auto-rollback decision.

When every rank has acked a placement, the step time over the window before its batch
index is on record; once the job has trained ``effect_window_steps`` batches past it (after
a short settle), the window after is measured. An auto-applied change that made steps
slower by more than the rollback threshold goes back. These functions only read
``LiveState`` and return data; the controller records and acts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backend.control.inputs import median

__all__ = [
    "SETTLE_STEPS", "Effect", "window_step_ms", "before_window", "after_window", "judge_effect",
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
                 rollback_threshold: float, may_roll_back: bool) -> Effect:
    """The gain of a placement, and whether it goes back: only when ``may_roll_back`` (an
    auto change in auto mode with shares to return to) and it is slower beyond the threshold."""
    before, after = step_ms_before, step_ms_after
    gain = (before - after) / before if before else None
    worse = before is not None and after > before * (1 + rollback_threshold)
    reason = None
    if worse and may_roll_back:
        reason = (f"measured step time rose from {before:.1f} ms to {after:.1f} ms "
                  f"after version {version}; rolling back")
    return Effect(step_ms_after=after, measured_gain=gain, rollback_reason=reason)


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

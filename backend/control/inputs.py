"""What the controller hands the policy, and the checks on what an operator may set.

Functions of a job's stored settings, its overrides and live measurements: the policy's
``PolicyConfig``, ``Constraints`` and ``ObservationRows`` (a ``JobObservation`` in rows),
per-sample costs, and validation of policy settings and overrides (``InvalidError`` naming the key and the rule it breaks).
Nothing here writes; the controller acts on what these return.

``backend.policy`` (numpy) is imported where it is used, as the controller always did.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, cast

from backend.control.errors import InvalidError, StateError
from backend.live.rows import STEP_BATCH as _BATCH
from backend.live.rows import STEP_COMPUTE as _COMPUTE
from backend.live.rows import STEP_LOCAL_BATCH as _LOCAL_BATCH

if TYPE_CHECKING:
    from backend.policy.types import (
        Constraints,
        ObservationRows,
        PolicyConfig,
        Rollback,
    )
    from backend.settings import Settings
    from backend.storage.control import OverridesRow

__all__ = [
    "OVERRIDE_KEYS", "policy_config", "knob", "policy_settings",
    "constraints_from", "all_said_hello", "observation_rows", "step_costs",
    "predict_step_ms", "validate_overrides", "check_overrides",
    "overrides_dict", "median", "rank_memories", "memory_explanation", "memory_constraints",
]

OVERRIDE_KEYS = ("pins", "caps", "floors", "drains", "granularity")

_DEVICE_SAMPLES = 60  # device samples per rank in an observation (~1 minute at 1 Hz)

# Controller knobs the policy never sees; their defaults are Settings fields of the same name.
_KNOBS = ("rollback_threshold", "effect_window_steps", "proposal_ttl_s", "proposal_margin", "proposal_min_age_s")


def _max_move_fraction(policy: Mapping[str, Any], settings: Settings) -> float:
    return float(policy.get("max_move_fraction", settings.auto_max_move_fraction))


# --- policy settings: the job's stored values over the defaults in Settings ----------------

def policy_config(policy: Mapping[str, Any], mode: str, settings: Settings) -> PolicyConfig:
    """The job's stored policy settings over the backend defaults, as a ``PolicyConfig``."""
    from backend.policy.types import PolicyConfig

    p, s = policy, settings
    return PolicyConfig(
        strategy=p.get("strategy", s.default_strategy),
        workload=p.get("workload", s.default_workload),
        custom_weights=p.get("custom_weights"),
        min_gain=float(p.get("min_gain", s.min_gain)),
        cooldown_steps=int(p.get("cooldown_steps", s.cooldown_steps)),
        min_steps=int(p.get("min_steps", s.min_steps)),
        window_steps=int(p.get("window_steps", s.policy_window_steps)),
        # The move cap is an auto-mode guardrail; an operator reviews the full change.
        max_move_fraction=_max_move_fraction(p, s) if mode == "auto" else None,
        horizon_steps=int(p.get("horizon_steps", s.horizon_steps)),
        params=dict(p.get("params", {})),
        memory_headroom=float(p.get("memory_headroom", s.memory_headroom)),
    )


def knob(policy: Mapping[str, Any], settings: Settings, name: str) -> Any:
    """A controller knob (rollback_threshold, effect_window_steps, proposal_ttl_s,
    proposal_margin, proposal_min_age_s)."""
    if name not in _KNOBS:
        raise ValueError(f"Unknown controller knob {name!r}; expected one of {', '.join(_KNOBS)}.")
    return policy.get(name, getattr(settings, name))


def policy_settings(policy: Mapping[str, Any], mode: str, settings: Settings) -> dict[str, Any]:
    """Effective policy settings of a job (stored values over the backend defaults)."""
    cfg = policy_config(policy, mode, settings)
    return {
        "strategy": cfg.strategy, "workload": cfg.workload, "custom_weights": cfg.custom_weights,
        "min_gain": cfg.min_gain, "cooldown_steps": cfg.cooldown_steps,
        "min_steps": cfg.min_steps, "window_steps": cfg.window_steps,
        "max_move_fraction": _max_move_fraction(policy, settings),
        "horizon_steps": cfg.horizon_steps, "params": cfg.params,
        "memory_headroom": cfg.memory_headroom,
        **{k: knob(policy, settings, k) for k in _KNOBS},
    }


def constraints_from(overrides: Mapping[str, Any]) -> Constraints:
    """The operator's overrides as policy constraints (``decide`` adds memory caps)."""
    from backend.policy.types import Constraints

    ov = overrides
    return Constraints(pins=dict(ov["pins"]), caps=dict(ov["caps"]), floors=dict(ov["floors"]),
                       drains=frozenset(ov["drains"]), granularity=int(ov["granularity"]))


# --- measurements ---------------------------------------------------------------------------

def all_said_hello(live: Any, job: str, world_size: int) -> bool:
    # The count first (O(1)): asked on every hello of a static job, ranks arriving one by one.
    if live.rank_count(job) < world_size:
        return False
    return all(live.hello(job, r) is not None for r in range(world_size))


def observation_rows(live: Any, job: str, *, world_size: int, global_batch_size: int,
                     shares: Sequence[int], version: int, effective: int | None,
                     window_steps: int, rollbacks: Sequence[Rollback] = (),
                     length_sq_weight: float = 0.0) -> ObservationRows | None:
    """The policy's snapshot of a job from ``LiveState``, as rows (``ObservationRows``: the
    objects are built where the policy runs); None until every rank said hello.
    ``length_sq_weight`` is the k of ``L + k*L^2`` the hooks split by.

    Each rank's steps are its newest ``window_steps`` steps with samples: a rank drained to
    share 0 keeps its last measured cost instead of looking unmeasured."""
    from backend.policy import RankMemory, normalize_device
    from backend.policy.types import ObservationRows

    view = live.view(job)
    if view is None or not all_said_hello(live, job, world_size):
        return None
    ranks = []
    for r in range(world_size):
        h = live.hello(job, r)
        # The strategies read the newest 60 device samples (clock and temperature trends).
        ranks.append((
            r,
            normalize_device(h.device_name or h.device_type, h.mem_total_bytes) if h else None,
            h.mem_total_bytes if h else None,
            _with_work(map(_STEP_SAMPLE, live.recent_work_rows(job, r, window_steps)),
                       live.work_by_batch(job, r)),
            tuple(map(_DEVICE_SIGNALS, live.recent_device_rows(job, r, _DEVICE_SAMPLES))),
            live.rank_memory(job, r) or RankMemory(),
        ))
    return ObservationRows(
        job=job, world_size=world_size, global_batch_size=global_batch_size,
        batch_index=view.batch_index or 0, shares=tuple(shares), placement_version=version,
        steps_since_change=max(0, (view.batch_index or 0) - (effective or 0)), ranks=tuple(ranks),
        rollbacks=tuple(rollbacks), comm=live.communication(job), length_sq_weight=length_sq_weight,
        pipeline=live.pipelines.observation(job, window_steps),  # None unless pipelined (docs/pipelines.md)
    )


# Step rows -> StepSample's fields; device rows (DEVICE_FIELDS: t, source, util, mem used,
# mem total, power, temp, sm clock, sm clock max, throttle reasons, cpu %, rss) ->
# DeviceSignals's (t, util, mem used, mem total, temp, sm clock, sm clock max, power, reasons).
_STEP_SAMPLE = itemgetter(_BATCH, _LOCAL_BATCH, _COMPUTE)
_DEVICE_SIGNALS = itemgetter(0, 2, 3, 4, 6, 7, 8, 5, 9)


def _with_work(rows: Any, work: dict[int, tuple[Any, ...]]) -> tuple[tuple[Any, ...], ...]:
    """Step rows with ``(work, batch_work, work_sq, batch_work_sq)`` appended where the
    step carried a cost."""
    if not work:
        return tuple(rows)
    return tuple((*row, *work[row[0]]) if row[0] in work else row for row in rows)


def step_costs(live: Any, job: str, world_size: int) -> list[float] | None:
    """Per-sample compute cost of each rank (median of recent steps), None without data."""
    if live is None:
        return None
    out = []
    for r in range(world_size):
        per = [s[_COMPUTE] / s[_LOCAL_BATCH]
               for s in live.recent_step_rows(job, r, 50) if s[_LOCAL_BATCH] > 0]
        if not per:
            return None
        out.append(median(per))
    return out


def predict_step_ms(costs: Sequence[float] | None, shares: Sequence[int]) -> float | None:
    """Slowest rank's compute time under ``shares``; None without costs."""
    return max(c * b for c, b in zip(costs, shares, strict=True)) if costs else None


def pipeline_prediction(live: Any, job: str, shares: Sequence[int]) -> dict[str, Any] | None:
    """The stage model's prediction for ``shares`` of a pipelined job, from its pipelines'
    times in force (``policy.pipeline_check.predict``); None for a job without pipelines or
    before any pipeline sent stage times."""
    po = live.pipelines.observation(job) if live is not None else None
    if po is None:
        return None
    from backend.policy.pipeline_check import predict

    got = predict(po, shares)
    return dict(got) if got is not None else None


def pipeline_check(live: Any, job: str, prediction: Mapping[str, Any], *, batches: tuple[int, int],
                   step_ms: float | None) -> dict[str, Any]:
    """``prediction`` with what was measured over ``batches`` (the effect window after its
    placement): each pipeline's run at its count and the job's step ``step_ms``."""
    from backend.policy.pipeline_check import PredictionRecord, check

    measured = live.pipelines.observation(job, batches=batches) if live is not None else None
    return dict(check(cast(PredictionRecord, dict(prediction)), measured, step_ms))


def rank_memories(live: Any, job: str, world_size: int) -> list[Any]:
    """Each rank's ``RankMemory`` (no fit, no source where the rank is unknown)."""
    from backend.policy import RankMemory

    return [(live.rank_memory(job, r) if live is not None else None) or RankMemory()
            for r in range(world_size)]


def memory_constraints(live: Any, job: str, overrides: Mapping[str, Any], shares: Sequence[int],
                       global_batch_size: int, headroom: float) -> Constraints:
    """The overrides as constraints with each rank's memory cap added (as ``decide`` does),
    for the placements the controller solves itself (new overrides, out of memory)."""
    from backend.policy import memory_bounds, with_caps

    memories = rank_memories(live, job, len(shares))
    caps = memory_bounds(memories, shares, global_batch_size, headroom)[0]
    return with_caps(constraints_from(overrides), caps)


def memory_explanation(memories: Sequence[Any], current: Sequence[int], shares: Sequence[int],
                       headroom: float) -> list[dict[str, Any]]:
    """Per rank: predicted peak before and after, memory cap and limit (None where the
    rank has no fit), for proposals that no policy run explains (manual, override)."""
    from backend.policy import memory_cap
    from backend.policy.memory import memory_limit_bytes

    out = []
    for i, rm in enumerate(memories):
        fit = rm.fit
        total = rm.total_bytes or (fit.total_bytes if fit else None)
        out.append({
            "rank": i,
            "mem_peak_before_bytes": fit.predict(current[i]) if fit else None,
            "mem_peak_after_bytes": fit.predict(shares[i]) if fit else None,
            "mem_cap": memory_cap(fit, total, headroom) if fit else None,
            "mem_limit_bytes": memory_limit_bytes(total, headroom) if fit and total else None,
        })
    return out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


# --- validation -----------------------------------------------------------------------------

def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def validate_overrides(o: Mapping[str, Any], *, world_size: int,
                       global_batch_size: int) -> dict[str, Any]:
    """Overrides as sent by an operator -> the normalised dict (int rank keys, sorted
    drains), or InvalidError naming the first entry that is wrong (``models.Overrides``)."""
    from pydantic import ValidationError

    from backend.control.models import Overrides

    try:
        ov = Overrides.model_validate(dict(o), context={"world_size": world_size,
                                                        "global_batch_size": global_batch_size})
    except ValidationError as exc:
        # Entries of the documented types and bounds that this job refuses (a rank it does
        # not have, more samples than its batch) are the job's refusal: 400, not 422.
        error = StateError if _documented_form(o) else InvalidError
        raise error(exc.errors()[0]["msg"]) from None
    return ov.normalised()


def _whole_in(v: Any, lo: int, hi: int) -> bool:
    ok = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
    return ok and not isinstance(v, bool) and lo <= v <= hi


def _documented_form(o: Mapping[str, Any]) -> bool:
    """True when ``o`` has the form the OpenAPI document gives overrides (types, bounds)."""
    from rebalancer_wire.protocol import MAX_GLOBAL_BATCH_SIZE, MAX_WORLD_SIZE

    for key in ("pins", "caps", "floors"):
        v = o.get(key, {})
        if not isinstance(v, dict) or not all(_whole_in(x, 0, MAX_GLOBAL_BATCH_SIZE) for x in v.values()):
            return False
        if not all(isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 5 for k in v):
            return False
    drains = o.get("drains", [])
    if not isinstance(drains, list) or not all(_whole_in(x, 0, MAX_WORLD_SIZE - 1) for x in drains):
        return False
    return _whole_in(o.get("granularity", 1), 1, MAX_GLOBAL_BATCH_SIZE)


def check_overrides(overrides: Mapping[str, Any], shares: Sequence[int], *,
                    global_batch_size: int) -> None:
    """Raise InvalidError naming the first override that ``shares`` breaks."""
    ov, g = overrides, overrides["granularity"]
    for r, v in ov["pins"].items():
        if shares[r] != v:
            raise StateError(f"Placement breaks the overrides: rank {r} is pinned to {v} samples but gets {shares[r]}.")
    for r in ov["drains"]:
        if shares[r] != 0:
            raise StateError(f"Placement breaks the overrides: rank {r} is drained but gets {shares[r]} samples.")
    for r, v in ov["caps"].items():
        if shares[r] > v:
            raise StateError(f"Placement breaks the overrides: rank {r} is capped at {v} samples but gets {shares[r]}.")
    for r, v in ov["floors"].items():
        if shares[r] < v:
            raise StateError(f"Placement breaks the overrides: rank {r} needs at least {v} samples but gets {shares[r]}.")
    if g > 1:
        fixed = set(ov["pins"]) | set(ov["drains"])
        off = [r for r, v in enumerate(shares) if r not in fixed and v % g]
        # When B is no multiple of g one rank must carry the remainder.
        if len(off) > (1 if global_batch_size % g else 0):
            raise StateError(f"Placement breaks the overrides: rank {off[0]} gets {shares[off[0]]} samples, not a multiple of the granularity {g}.")


def overrides_dict(row: OverridesRow | None) -> dict[str, Any]:
    """Stored overrides (string rank keys) -> the controller's dict; none stored -> empty."""
    if row is None:
        return {"pins": {}, "caps": {}, "floors": {}, "drains": [], "granularity": 1}
    return {
        "pins": {int(k): int(v) for k, v in (row.pins or {}).items()},
        "caps": {int(k): int(v) for k, v in (row.caps or {}).items()},
        "floors": {int(k): int(v) for k, v in (row.floors or {}).items()},
        "drains": sorted(int(r) for r in (row.drains or [])),
        "granularity": int(row.granularity or 1),
    }

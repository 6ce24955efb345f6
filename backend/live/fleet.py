"""The one home of the fleet summary: every job's row and the fleet's totals, from per-job
figures the dashboard hub gathers. The home page's live feed, ``GET /api/v1/fleet`` and the
``rebalancer_fleet_*`` series of ``/metrics`` all read what ``fleet_summary`` returns (the
hub computes it at most once per tick and keeps it: ``DashboardHub.fleet``).

- efficiency: the balanced step time over the achieved one (1.0: nothing left to gain by
  moving work). The balanced step swaps the slowest rank's predicted compute under the
  placement in force for the oracle's (the exact min-max split under the policy's own
  per-rank fit ``a_i + c_i * b``); synchronisation and overheads stay. None (n/a) until the
  policy has fitted the job.
- wasted GPU-hours: per closed batch, the time ranks spent waiting for the slowest rank's
  compute, ``sum_i (max_j compute_j - compute_i)``, summed since the backend took the job in.
- saved: ``backend.live.forecast.savings`` (time and cost against the uniform split).
- running: a job whose status is anything but ``idle``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from backend.policy.solver import predicted_step_ms, solve

__all__ = ["FleetJob", "fleet_summary", "balance_gap_ms", "fleet_job_dict", "fleet_job_from_dict", "MS_PER_HOUR"]

MS_PER_HOUR = 3.6e6


@dataclass(frozen=True, slots=True)
class FleetJob:
    """One job's figures, as the hub holds them (the input of ``fleet_summary``)."""

    job: str
    status: str
    status_detail: str = ""
    mode: str | None = None
    world_size: int = 0
    connected_ranks: int = 0
    devices: tuple[tuple[str, int], ...] = ()  # (device kind, ranks), most ranks first
    step_ms: float | None = None
    balance_gap_ms: float | None = None  # predicted compute the oracle split would save a step
    wasted_ms: float = 0.0  # rank-milliseconds spent waiting for the slowest rank's compute
    saved_s: float | None = None
    saved_cost: float | None = None
    cost_per_hour: float | None = None
    imbalance: float | None = None
    eta_s: float | None = None
    batch_index: int | None = None
    bound: Any = None  # compute, communication or input (None: not known); see _bound
    pending_proposal_id: int | None = None  # a proposal waiting for an operator
    goodput: float | None = None  # useful compute / paid device time (backend.live.forecast.goodput)


_MAX_INT = 2**53  # JSON integers every reader keeps exact
_FLOATS = ("step_ms", "balance_gap_ms", "saved_s", "saved_cost", "cost_per_hour", "imbalance", "eta_s", "goodput")


def fleet_job_dict(j: FleetJob) -> dict[str, Any]:
    """``j`` as JSON-ready data, for another replica's fleet (``fleet_job_from_dict``)."""
    return {
        "job": j.job, "status": j.status, "status_detail": j.status_detail, "mode": j.mode,
        "world_size": j.world_size, "connected_ranks": j.connected_ranks,
        "devices": [[kind, n] for kind, n in j.devices], "wasted_ms": j.wasted_ms,
        **{k: getattr(j, k) for k in _FLOATS},
        "batch_index": j.batch_index, "bound": _bound(j.bound), "pending_proposal_id": j.pending_proposal_id,
    }


def _text(d: dict[str, Any], key: str, most: int, *, optional: bool = False) -> Any:
    v = d.get(key)
    if (v is None and optional) or (isinstance(v, str) and len(v) <= most):
        return v
    raise ValueError(f"fleet row {key!r} must be a string of at most {most} characters, got {type(v).__name__}.")


def _count(d: dict[str, Any], key: str, *, optional: bool = False) -> Any:
    v = d.get(key)
    if (v is None and optional) or (type(v) is int and 0 <= v <= _MAX_INT):
        return v
    raise ValueError(f"fleet row {key!r} must be an integer between 0 and {_MAX_INT}, got {v!r}.")


def _number(d: dict[str, Any], key: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if type(v) not in (int, float) or not math.isfinite(v):
        raise ValueError(f"fleet row {key!r} must be a finite number or null, got {v!r}.")
    return float(v)


def fleet_job_from_dict(d: Any) -> FleetJob:
    """A row another replica stored (``fleet_job_dict``), checked: ValueError naming the field."""
    if not isinstance(d, dict):
        raise ValueError(f"a fleet row must be a JSON object, got {type(d).__name__}.")
    devices = d.get("devices")
    if (not isinstance(devices, list) or len(devices) > 64
            or not all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and len(x[0]) <= 256
                       and type(x[1]) is int and 0 <= x[1] <= _MAX_INT for x in devices)):
        raise ValueError("fleet row 'devices' must be a list of at most 64 [device kind, ranks] pairs.")
    wasted = _number(d, "wasted_ms")
    if wasted is None or wasted < 0:
        raise ValueError(f"fleet row 'wasted_ms' must be a finite number >= 0, got {d.get('wasted_ms')!r}.")
    job = _text(d, "job", 256)
    if not job:
        raise ValueError("fleet row 'job' must not be empty.")
    return FleetJob(
        job=job, status=_text(d, "status", 64), status_detail=_text(d, "status_detail", 4096),
        mode=_text(d, "mode", 64, optional=True), world_size=_count(d, "world_size"),
        connected_ranks=_count(d, "connected_ranks"), devices=tuple((k, n) for k, n in devices),
        wasted_ms=wasted, **{k: _number(d, k) for k in _FLOATS},
        batch_index=_count(d, "batch_index", optional=True), bound=_text(d, "bound", 64, optional=True),
        pending_proposal_id=_count(d, "pending_proposal_id", optional=True),
    )


def balance_gap_ms(a_ms: Sequence[float], c_ms: Sequence[float], shares: Sequence[int],
                   global_batch_size: int) -> float | None:
    """Predicted slowest compute under ``shares`` minus under the oracle split (>= 0), from
    the policy's per-rank fit; None when the fit does not match the placement or is unusable."""
    if not shares or not (len(a_ms) == len(c_ms) == len(shares)) or sum(shares) != global_batch_size:
        return None
    try:
        best = predicted_step_ms(a_ms, c_ms, solve(a_ms, c_ms, global_batch_size))
        now = predicted_step_ms(a_ms, c_ms, shares)
    except ValueError:  # a bad fit (negative or non-finite cost): say n/a, not a wrong figure
        return None
    return max(now - best, 0.0)


def _efficiency(j: FleetJob) -> tuple[float | None, float | None]:
    """(balanced step ms, balanced / achieved) or (None, None)."""
    if j.step_ms is None or j.step_ms <= 0 or j.balance_gap_ms is None:
        return None, None
    balanced = max(j.step_ms - j.balance_gap_ms, 0.0)
    return balanced, min(balanced / j.step_ms, 1.0)


def _bound(v: Any) -> str | None:
    """The verdict of a job's ``bound`` (a word, or a mapping holding it as ``bound`` or
    ``verdict``); None where there is none."""
    if isinstance(v, dict):
        v = v.get("bound") or v.get("verdict")
    return v if isinstance(v, str) and v else None


def _r(v: float | None, nd: int = 6) -> float | None:
    return None if v is None else round(v, nd)


def fleet_summary(jobs: Iterable[FleetJob]) -> dict[str, Any]:
    """``{"data": rows, "count", "totals"}``: one row per job (by name) and the fleet's totals."""
    rows: list[dict[str, Any]] = []
    ranks = connected = running = pending = 0
    wasted_ms = saved_s = 0.0
    saved_cost: float | None = None
    eff_num = eff_den = 0.0
    by_status: dict[str, int] = {}
    for j in sorted(jobs, key=lambda j: j.job):
        balanced, eff = _efficiency(j)
        is_pending = j.pending_proposal_id is not None
        rows.append({
            "job": j.job, "status": j.status, "status_detail": j.status_detail, "mode": j.mode,
            "world_size": j.world_size, "connected_ranks": j.connected_ranks,
            "devices": [{"kind": k, "count": n} for k, n in j.devices],
            "step_ms": _r(j.step_ms, 4), "balanced_step_ms": _r(balanced, 4), "efficiency": _r(eff, 4),
            "wasted_gpu_hours": j.wasted_ms / MS_PER_HOUR,
            "saved_s": _r(j.saved_s, 3), "saved_cost": _r(j.saved_cost),
            "cost_per_hour": _r(j.cost_per_hour, 4), "imbalance": _r(j.imbalance, 4),
            "eta_s": _r(j.eta_s, 3), "batch_index": j.batch_index, "bound": _bound(j.bound),
            "goodput": _r(j.goodput, 4),
            "pending_proposals": 1 if is_pending else 0, "pending_proposal_id": j.pending_proposal_id,
        })
        ranks += j.world_size
        connected += j.connected_ranks
        running += j.status not in ("idle", "ended")
        pending += is_pending
        wasted_ms += j.wasted_ms
        saved_s += j.saved_s or 0.0
        if j.saved_cost is not None:
            saved_cost = (saved_cost or 0.0) + j.saved_cost
        if eff is not None:
            eff_num += eff * j.world_size
            eff_den += j.world_size
        by_status[j.status] = by_status.get(j.status, 0) + 1
    totals = {
        "jobs": len(rows), "ranks": ranks, "connected_ranks": connected, "running": running,
        "by_status": dict(sorted(by_status.items())),
        "wasted_gpu_hours": wasted_ms / MS_PER_HOUR, "saved_s": round(saved_s, 3),
        "saved_cost": _r(saved_cost), "pending_proposals": pending,
        # rank-weighted mean over the jobs that have a figure
        "efficiency": round(eff_num / eff_den, 4) if eff_den else None,
    }
    return {"data": rows, "count": len(rows), "totals": totals}

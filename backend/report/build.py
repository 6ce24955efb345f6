"""The end-of-run report as data: a pure function of what storage, the controller and the
forecast rules hand it (no I/O here; ``backend.report.collect`` gathers the inputs).

Figures and where they come from:
- duration, steps, samples/s, time per rank split into compute / sync wait / data wait /
  optimizer: the stored per-rank metric windows, summed (``storage.reports.rank_totals``);
- placements with their measured gains, proposals and their decisions: the controller;
- time and money saved against the uniform split: the run's summary (the dashboard feed's
  savings, ``backend.live.forecast.savings``);
- cost per hour: ``backend.live.forecast.hourly_cost``; in total: that times the duration;
- advice: the policy's fit of each rank (``policy._fit.fit_steps``) and its solver, through
  ``policy.advice.drop_effects``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from backend.policy._fit import fit_steps, valid_steps
from backend.policy.advice import drop_effects
from backend.policy.types import InfeasibleError, StepSample
from backend.storage.reports import RankTotals

__all__ = ["RankInfo", "ReportInputs", "build_report", "REPORT_VERSION"]

REPORT_VERSION = 1


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    host: str
    device_type: str
    device_name: str
    price_per_hour: float | None


@dataclass(frozen=True, slots=True)
class ReportInputs:
    job: str
    world_size: int
    global_batch_size: int
    finished: bool
    reason: str  # why the report was made: "every rank said goodbye", "on demand"
    generated_at: float
    ranks: Sequence[RankInfo]
    totals: Sequence[RankTotals]
    series: Sequence[dict[str, Any]]
    fit_windows: dict[int, list[tuple[int, float, float]]]  # rank -> (batch, lbs, compute_ms)
    placements: Sequence[dict[str, Any]]
    proposals: Sequence[dict[str, Any]]
    savings: dict[str, Any] | None
    cost_per_hour: float | None
    unpriced_ranks: int
    fit_window_steps: int = 100
    # What bounded the step over the run's last steps, with per-rank communication
    # (``backend.policy.comm``, as the REST ``bound`` object plus ``ranks``); None: unknown.
    communication: dict[str, Any] | None = None
    # Why the run was slow over its last steps (``backend.policy.causes``: each cause as the
    # REST ``/causes`` item, largest first); None: unknown (live state no longer held them).
    causes: list[dict[str, Any]] | None = None
    goodput: float | None = None  # useful compute / paid device time over the last steps
    # A pipelined job over its last steps (``backend.live.pipeline.pipeline_view``: the REST
    # ``/pipeline`` object: grid, bottleneck stage, bubble share, stage-split advice); None:
    # not pipelined, or live state no longer held it.
    pipeline: dict[str, Any] | None = None


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


def _rank_rows(inp: ReportInputs) -> list[dict[str, Any]]:
    info = {r.rank: r for r in inp.ranks}
    rows = []
    for t in inp.totals:
        n = max(t.steps, 1)
        i = info.get(t.rank)
        rows.append({
            "rank": t.rank, "host": i.host if i else "", "device_type": i.device_type if i else "",
            "device_name": i.device_name if i else "", "price_per_hour": i.price_per_hour if i else None,
            "steps": t.steps, "mean_local_batch_size": _r(t.samples / n, 3),
            "compute_s": _r(t.compute_ms / 1000), "sync_wait_s": _r(t.sync_wait_ms / 1000),
            "data_wait_s": _r(t.data_wait_ms / 1000), "optimizer_s": _r(t.optimizer_ms / 1000),
            "step_s": _r(t.step_ms / 1000),
            "compute_ms_per_step": _r(t.compute_ms / n, 3), "sync_wait_ms_per_step": _r(t.sync_wait_ms / n, 3),
            "data_wait_ms_per_step": _r(t.data_wait_ms / n, 3),
        })
    return rows


def _placements(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in sorted(rows, key=lambda p: p["version"]):
        eff = p.get("effect") or {}
        out.append({
            "version": p["version"], "source": p["source"], "shares": list(p["shares"]),
            "previous_shares": p.get("previous_shares"), "proposal_id": p.get("proposal_id"),
            "actor": p.get("actor", ""), "reason": p.get("reason", ""), "created_at": p.get("created_at"),
            "effective_batch_index": p.get("effective_batch_index"), "failed": bool(p.get("failed")),
            "step_ms_before": eff.get("step_ms_before"), "step_ms_after": eff.get("step_ms_after"),
            "predicted_step_ms": eff.get("predicted_step_ms"), "measured_gain": eff.get("measured_gain"),
            "rolled_back": bool(eff.get("rolled_back")), "prediction": eff.get("prediction"),
        })
    return out


def _proposals(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = ("id", "status", "source", "strategy", "shares", "predicted_gain", "reason", "created_by",
            "created_at", "decided_by", "decided_at", "decision_reason", "placement_version")
    return [{k: p.get(k) for k in keep} for p in sorted(rows, key=lambda p: p["id"])]


def _advice(inp: ReportInputs, rank_rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    fits = []
    for r in range(inp.world_size):
        samples = [StepSample(batch_index=b, local_batch_size=max(int(round(lbs)), 0), compute_ms=ms)
                   for b, lbs, ms in inp.fit_windows.get(r, [])]
        good = valid_steps(samples, inp.fit_window_steps)
        if len(good) < 2:
            return None
        fits.append(fit_steps(good, recent=0))
    by_rank = {row["rank"]: row for row in rank_rows}
    if set(by_rank) != set(range(inp.world_size)):
        return None
    # What a split does not change: the step beyond the slowest rank's compute.
    step = [by_rank[r]["step_s"] / max(by_rank[r]["steps"], 1) * 1000 for r in range(inp.world_size)]
    compute = [by_rank[r]["compute_ms_per_step"] or 0.0 for r in range(inp.world_size)]
    overhead = max(0.0, sum(step) / len(step) - max(compute))
    prices = [by_rank[r]["price_per_hour"] for r in range(inp.world_size)]
    try:
        step_all, drops = drop_effects([f.a_ms for f in fits], [f.c_ms for f in fits],
                                       inp.global_batch_size, prices, overhead_ms=overhead)
    except (InfeasibleError, ValueError):
        return None
    release = [d.advice for d in drops if d.cost_per_sample_change is not None and d.cost_per_sample_change < 0]
    return {
        "model": "t_i(b) = a_i + c_i * b per rank (the policy's robust fit of the stored windows); "
                 "best split by the policy's solver, with and without each rank",
        "overhead_ms": _r(overhead, 3),
        "predicted_step_ms": _r(step_all, 3),
        "fits": [{"rank": r, "a_ms": _r(f.a_ms, 4), "c_ms": _r(f.c_ms, 5), "n": f.n, "method": f.method}
                 for r, f in enumerate(fits)],
        "drop": [{**{k: (_r(v) if isinstance(v, float) else v) for k, v in asdict(d).items()},
                  "shares_without": list(d.shares_without) if d.shares_without is not None else None}
                 for d in drops],
        "summary": release or ["every rank pays for itself: keep them all"],
    }


def build_report(inp: ReportInputs) -> dict[str, Any]:
    """The report (JSON-ready). Keys: see docs/api.md, "End-of-run report"."""
    rank_rows = _rank_rows(inp)
    t0 = min((t.t_start for t in inp.totals), default=None)
    t1 = max((t.t_end for t in inp.totals), default=None)
    steps = max((t.steps for t in inp.totals), default=0)
    duration = (t1 - t0) if t0 is not None and t1 is not None else None
    # t_start is the end of a window's first step: add one mean step for the first step.
    if duration is not None and steps:
        first = [t.step_ms / t.steps for t in inp.totals if t.steps]
        duration += sum(first) / len(first) / 1000.0
    samples_per_s = steps * inp.global_batch_size / duration if duration else None
    placements = _placements(inp.placements)
    proposals = _proposals(inp.proposals)
    savings = dict(inp.savings) if inp.savings else None
    if savings and savings.get("uniform_s"):
        savings["saved_fraction"] = _r(savings["saved_s"] / savings["uniform_s"])
    cost_total = (inp.cost_per_hour * duration / 3600.0
                  if inp.cost_per_hour is not None and duration is not None else None)
    return {
        "report_version": REPORT_VERSION,
        "job": inp.job, "world_size": inp.world_size, "global_batch_size": inp.global_batch_size,
        "finished": inp.finished, "reason": inp.reason, "generated_at": inp.generated_at,
        "started_at": t0, "ended_at": t1, "duration_s": _r(duration, 3), "steps": steps,
        "samples": steps * inp.global_batch_size, "samples_per_s": _r(samples_per_s, 3),
        "mean_step_ms": _r(1000 * duration / steps, 3) if duration and steps else None,
        "ranks": rank_rows,
        "placements": placements,
        "final_shares": placements[-1]["shares"] if placements else None,
        "proposals": proposals,
        "decisions": dict(sorted(Counter(p["status"] for p in proposals).items())),
        "savings": savings,
        "cost": {"per_hour": _r(inp.cost_per_hour, 9), "total": _r(cost_total, 9),
                 "unpriced_ranks": inp.unpriced_ranks},
        "advice": _advice(inp, rank_rows),
        "communication": inp.communication,
        "causes": inp.causes,
        "goodput": _r(inp.goodput),
        "pipeline": inp.pipeline,
        "series": list(inp.series),
    }

"""What-if against reality: each cause of lost step time injected into a real CPU job, the
cause the replay names first and its predicted gain against the gain measured when the
cause is removed for real; and the gain of the hook's GC settings on a job that allocates.

One torchrun/gloo job of 3 ranks (tests/backend/_causes_worker.py) trains in phases of
``--phase-steps`` steps: each cause phase injects one cause for real (rank 1's loader
sleeping 40 ms; rank 2 computing twice as long per unit of work, 8 ms a unit; rank 1
collecting its young generation inside every step, over a cycle whose finalizer takes
35 ms; one sample of 8 units of work in every batch of 12 units; the gradient all-reduce
finishing 60 ms late every other step; all of them times ``--scale``, 2 by default: a loaded
machine's late wake-ups, a few ms a step, then weigh half as much against the gain), and
the ``clean`` phases (one after each pair of cause phases) inject none. Each
cause phase's steps (after ``WARMUP``) are replayed by ``backend.policy.causes.attribute``
(the function the backend's ``GET /api/v1/jobs/{job}/causes`` calls); the measured gain is
the phase's mean step minus the clean phases' mean step, from the same run.

GC: two more runs of the same job, every rank holding 400,000 live lists from setup and
making cyclic garbage every step (rank r a tenth more per rank, so Python's own full
collections pause ranks at different steps): without the GC settings, then with
``gc_freeze=True, gc_collect_every=--gc-every``. Reported: both mean steps, the measured
gain, and the replay's ``gc`` cause on the first run (every pause gone: the most the
settings could gain).

    python -m bench.causes [--phase-steps 40] [--scale 2] [--gc-steps 120] [--gc-every 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from backend.policy.causes import CauseReport, CauseStep, attribute
from bench._report import RESULTS_DIR, print_table, write_json
from rebalancer_wire.protocol import StepRecord
from tests.helpers.torchrun import run_torchrun

__all__ = ["main", "run_job", "cause_sizes", "load_phases", "mean_step_ms", "whatif", "EXPECTED", "NPROC", "GLOBAL_BATCH"]

NPROC = 3
GLOBAL_BATCH = 12
WARMUP = 4  # each phase's first steps: the previous phase's state still drains
TRIM = 0.25  # the measured step's cut at each end: the interquartile mean
# phase -> (the cause the replay must name first, its ranks)
EXPECTED: dict[str, tuple[str, tuple[int, ...]]] = {
    "data_wait": ("data_wait", (1,)),
    "slow_rank": ("slow_rank", (2,)),
    "gc": ("gc", (1,)),
    "sample_cost_skew": ("sample_cost_skew", (0,)),  # the work split gives rank 0 the long sample
    "communication": ("communication", (0, 1, 2)),
}
PHASE_ORDER = ("data_wait", "slow_rank", "clean", "gc", "sample_cost_skew", "clean", "communication", "clean")


def run_job(out: Path, phases: tuple[str, ...], phase_steps: int, *extra: str, timeout: float = 600.0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    run_torchrun(NPROC, ["-m", "tests.backend._causes_worker", "--out", str(out), "--phases", ",".join(phases),
                         "--phase-steps", str(phase_steps), *extra], timeout=timeout)


def load_phases(out: Path, phase_steps: int, warmup: int = WARMUP) -> dict[str, dict[int, list[CauseStep]]]:
    """Each phase's steps per rank (a phase's first ``warmup`` steps left out), every record
    through the wire's checks (``StepRecord.from_dict``: the phases must add up)."""
    by_phase: dict[str, dict[int, list[CauseStep]]] = {}
    for rank in range(NPROC):
        rows: list[dict[str, Any]] = json.loads((out / f"rank{rank}.json").read_text())
        for row in rows:
            phase = row.pop("phase")
            if row["batch_index"] % phase_steps < warmup:
                continue
            rec = StepRecord.from_dict(row)
            by_phase.setdefault(phase, {}).setdefault(rank, []).append(CauseStep(
                batch_index=rec.batch_index, local_batch_size=rec.local_batch_size,
                data_wait_ms=rec.data_wait_ms, compute_ms=rec.compute_ms, sync_wait_ms=rec.sync_wait_ms,
                optimizer_ms=rec.optimizer_ms, step_ms=rec.step_ms, host_ms=rec.host_ms or 0.0,
                ckpt_ms=rec.ckpt_ms or 0.0, gc_ms=sum(rec.gc_ms) if rec.gc_ms else 0.0,
                comm_bytes=rec.comm_bytes, comm_ms=rec.comm_ms, work=rec.work))
    return by_phase


def mean_step_ms(steps: dict[int, list[CauseStep]], trim: float = TRIM) -> float:
    """The phase's measured step: the mean over its steps of the ranks' median step time,
    ``trim`` of the steps left out at each end (a loaded machine's late wake-ups; a
    symmetric cut keeps a phase that alternates slow and fast steps at its mean)."""
    by_k: dict[int, list[float]] = {}
    for rows in steps.values():
        for s in rows:
            by_k.setdefault(s.batch_index, []).append(s.step_ms)
    xs = sorted(statistics.median(v) for v in by_k.values())
    cut = int(len(xs) * trim)
    return statistics.fmean(xs[cut:len(xs) - cut] if len(xs) > 2 * cut else xs)


def whatif(by_phase: dict[str, dict[int, list[CauseStep]]], phase: str, steps_done: int) -> tuple[CauseReport, float]:
    """The replay of ``phase`` and the gain measured against the clean phases."""
    report = attribute(by_phase[phase], global_batch_size=GLOBAL_BATCH, steps_done=steps_done, window=1024)
    return report, mean_step_ms(by_phase[phase]) - mean_step_ms(by_phase["clean"])


def cause_sizes(scale: float) -> tuple[str, ...]:
    """The worker's arguments for causes ``scale`` times the worker's defaults."""
    return ("--loader-ms", str(40 * scale), "--sample-ms", str(8 * scale), "--gc-ms", str(35 * scale),
            "--comm-ms", str(60 * scale))


def _cause_rows(tmp: Path, phase_steps: int, scale: float) -> list[dict[str, Any]]:
    out = tmp / "causes"
    run_job(out, PHASE_ORDER, phase_steps, *cause_sizes(scale))
    by_phase = load_phases(out, phase_steps)
    rows = []
    for phase, (cause, ranks) in EXPECTED.items():
        report, measured = whatif(by_phase, phase, phase_steps * len(PHASE_ORDER))
        top = report.causes[0] if report.causes else None
        predicted = top.ms_per_step if top else 0.0
        rows.append({"injected": phase, "expected": [cause, list(ranks)],
                     "named": [top.cause, list(top.ranks)] if top else None,
                     "named_right": bool(top and (top.cause, top.ranks) == (cause, ranks)),
                     "predicted_gain_ms": round(predicted, 1), "measured_gain_ms": round(measured, 1),
                     "error": round(predicted / measured - 1.0, 3) if measured > 0 else None,
                     "step_ms": round(mean_step_ms(by_phase[phase]), 1),
                     "replayed_step_ms": round(report.replayed_step_ms or 0.0, 1),
                     "others": [[c.cause, round(c.ms_per_step, 1)] for c in report.causes[1:4]]})
    return rows


def _gc_row(tmp: Path, steps: int, every: int) -> dict[str, Any]:
    runs: dict[str, dict[int, list[CauseStep]]] = {}
    for name, extra in (("off", ()), ("on", ("--gc-freeze", "--gc-every", str(every)))):
        out = tmp / f"gc_{name}"
        run_job(out, ("alloc",), steps, "--setup-objects", "400000", "--garbage", "20000", *extra)
        runs[name] = load_phases(out, steps, warmup=WARMUP)["alloc"]
    off, on = mean_step_ms(runs["off"]), mean_step_ms(runs["on"])
    report = attribute(runs["off"], global_batch_size=GLOBAL_BATCH, steps_done=steps, window=1024)
    gc_cause = next((c for c in report.causes if c.cause == "gc"), None)

    def pauses(steps_of: dict[int, list[CauseStep]]) -> float:  # mean GC ms a rank-step
        return statistics.fmean(s.gc_ms for rows in steps_of.values() for s in rows)

    return {"steps": steps, "gc_collect_every": every, "step_ms_off": round(off, 1), "step_ms_on": round(on, 1),
            "measured_gain_ms": round(off - on, 1), "measured_gain_share": round((off - on) / off, 3),
            "predicted_gain_all_pauses_gone_ms": round(gc_cause.ms_per_step, 1) if gc_cause else 0.0,
            "gc_share_off": round(report.gc_share, 3),
            "gc_ms_per_rank_step_off": round(pauses(runs["off"]), 2),
            "gc_ms_per_rank_step_on": round(pauses(runs["on"]), 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase-steps", type=int, default=40)
    p.add_argument("--scale", type=float, default=2.0, help="every injected cause's size, times the worker's defaults")
    p.add_argument("--gc-steps", type=int, default=120)
    p.add_argument("--gc-every", type=int, default=50)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = _cause_rows(Path(tmp), args.phase_steps, args.scale)
        gc_row = _gc_row(Path(tmp), args.gc_steps, args.gc_every)
    print_table("What-if against removing the cause for real (3 gloo ranks)",
                ["injected", "named first", "predicted gain", "measured gain", "error"],
                [[r["injected"], f"{r['named'][0]} {r['named'][1]}" if r["named"] else "-",
                  f"{r['predicted_gain_ms']} ms", f"{r['measured_gain_ms']} ms",
                  f"{r['error']:+.1%}" if r["error"] is not None else "-"] for r in rows])
    print_table("GC settings on a job that allocates (gc_freeze + gc_collect_every)",
                ["step off", "step on", "measured gain", "replay: all pauses gone"],
                [[f"{gc_row['step_ms_off']} ms", f"{gc_row['step_ms_on']} ms",
                  f"{gc_row['measured_gain_ms']} ms ({gc_row['measured_gain_share']:.1%})",
                  f"{gc_row['predicted_gain_all_pauses_gone_ms']} ms"]])
    write_json(RESULTS_DIR / "causes.json", {"phase_steps": args.phase_steps, "scale": args.scale, "rows": rows,
                                             "gc": gc_row})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

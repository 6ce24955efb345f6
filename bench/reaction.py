"""Reaction: how fast a strategy follows when a rank's speed changes during the run.

Real 4-rank torchrun/gloo CPU jobs (trainer_hook.demo_worker), all ranks equally fast at
first, in ``auto`` mode from no knowledge:

- slowdown: rank 3 becomes 2x slower at step ``event`` (``--slowdown 3:EVENT:2``);
- drift: rank 3 gets slower by 1% of its original time every step from step ``event``
  (``--drift 3:EVENT:1``: linear, 2x after 100 steps).

The reference is the moving oracle: the exact best split's step time for the true costs
at each step (the product's solver on the injected costs) plus the fixed overhead the
split cannot change (sync, framework), measured once as an oracle run's steady step time
minus its model step time. Reported per strategy: steps after the event until the split in
force stays within 10% of the moving oracle's model step time (from the placement
timeline; noise-free), the same judged from measured step times (90% of rolling medians
of 10 steps within 10% of the reference), and the excess time paid over the reference
from the event to the end of the run (uniform shows what doing nothing costs).

    python -m bench.reaction [--quick | --tiny]
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench._analysis import (
    excess_ms,
    model_step_ms,
    oracle_shares,
    steady_ms,
    steps_until_split_within,
    steps_until_within,
)
from bench._backend import running_backend, stop_on_sigterm
from bench._jobs import JobSpec, run_job
from bench._report import RESULTS_DIR, print_table, write_json

__all__ = ["ReactionRow", "run_reaction", "cost_at", "main"]

SPEEDS = (1.0, 1.0, 1.0, 1.0)
SLOW_RANK = 3
QUICK: dict[str, Any] = {"steps": 90, "event": 40, "strategies": ("profiled", "predictive"),
                         "events": ("slowdown",)}


@dataclass
class ReactionRow:
    event: str
    strategy: str
    steps_to_within_10pct: int | None  # split in force within 10% of the moving oracle (model)
    steps_to_within_10pct_measured: int | None  # measured rolling median within 10% of reference
    excess_ms: float  # over the moving oracle, event to end of run
    excess_ms_per_step: float
    steady_after_ms: float
    reference_end_ms: float
    placements_applied: int
    notes: list[str]  # retries, a crash at teardown: anything that was not a clean run


def cost_at(spec: JobSpec, step: int) -> tuple[list[float], list[float]]:
    """True (a_ms, c_ms) of every rank at ``step``, as trainer_hook.demo_worker.delay_ms
    injects them: a slowdown multiplies the rank's whole compute time by FACTOR from STEP
    on; a drift by ``1 + PCT/100 * (step - START)`` (linear) from START on."""
    a, c = spec.a_ms, spec.c_ms
    factor = [1.0] * len(a)
    if spec.slowdown:
        rank, at, f = spec.slowdown.split(":")
        if step >= int(at):
            factor[int(rank)] *= float(f)
    if spec.drift:
        rank, at, pct = spec.drift.split(":")
        if step >= int(at):
            factor[int(rank)] *= max(0.0, 1.0 + float(pct) / 100.0 * (step - int(at)))
    return [x * f for x, f in zip(a, factor, strict=True)], [x * f for x, f in zip(c, factor, strict=True)]


def _reference(spec: JobSpec, overhead_ms: float) -> list[float]:
    out = []
    for k in range(spec.steps):
        a, c = cost_at(spec, k)
        out.append(model_step_ms(a, c, oracle_shares(a, c, spec.global_batch_size)) + overhead_ms)
    return out


def run_reaction(
    *, steps: int = 200, event: int = 100, strategies: tuple[str, ...] = ("uniform", "profiled", "predictive"),
    events: tuple[str, ...] = ("slowdown", "drift"), out_dir: Path = RESULTS_DIR,
    name: str = "reaction", plot: bool = True, global_batch_size: int = 64,
    per_sample_ms: float = 2.0, fixed_ms: float = 2.0, drift_pct: float = 1.0,
) -> dict[str, Any]:
    """Run each event under each strategy; write ``<name>.json`` and ``<name>.png``."""
    rows: list[ReactionRow] = []
    plots: dict[str, dict[str, Any]] = {}
    base = dict(speeds=SPEEDS, global_batch_size=global_batch_size, per_sample_ms=per_sample_ms,
                fixed_ms=fixed_ms)
    with tempfile.TemporaryDirectory(prefix="rb-react-") as tmp, running_backend(Path(tmp)) as backend:
        # Overhead the split cannot remove: an oracle run of the starting speeds.
        oracle_spec = JobSpec(job="react-oracle", steps=max(40, min(60, steps // 3)), **base)  # type: ignore[arg-type]
        oracle_run = run_job(backend, oracle_spec, "oracle")
        model0 = model_step_ms(oracle_spec.a_ms, oracle_spec.c_ms,
                               oracle_shares(oracle_spec.a_ms, oracle_spec.c_ms, global_batch_size))
        overhead = max(0.0, steady_ms(oracle_run.step_ms) - model0)
        print(f"  overhead outside the split: {overhead:.1f} ms (oracle run steady "
              f"{steady_ms(oracle_run.step_ms):.1f} ms, model {model0:.1f} ms)", flush=True)
        for ev in events:
            what = {"slowdown": {"slowdown": f"{SLOW_RANK}:{event}:2"},
                    "drift": {"drift": f"{SLOW_RANK}:{event}:{drift_pct:g}"}}[ev]
            series: dict[str, list[float]] = {}
            timelines: dict[str, list[dict[str, Any]]] = {}
            ref: list[float] = []
            for strategy in strategies:
                spec = JobSpec(job=f"react-{ev}-{strategy}", steps=steps, **base, **what)  # type: ignore[arg-type]
                run = run_job(backend, spec, strategy)
                ref = _reference(spec, overhead)
                n = min(len(run.step_ms), len(ref))
                ys, r = run.step_ms[:n], ref[:n]
                exc = excess_ms(ys, lambda k, r=r: r[k], start=event)
                rows.append(ReactionRow(
                    event=ev, strategy=strategy,
                    steps_to_within_10pct=steps_until_split_within(
                        run.placements, lambda k, spec=spec: cost_at(spec, k), n,
                        global_batch_size, 0.10, start=event),
                    steps_to_within_10pct_measured=steps_until_within(
                        ys, lambda k, r=r: r[k], 0.10, start=event),
                    excess_ms=round(exc, 1), excess_ms_per_step=round(exc / max(1, n - event), 2),
                    steady_after_ms=round(steady_ms(ys, 0.15, 10), 2), reference_end_ms=round(r[-1], 2),
                    placements_applied=max(0, len(run.placements) - 1),
                    notes=[n for n in run.notes if "applied by hand" not in n],
                ))
                series[strategy] = ys
                timelines[strategy] = run.placements
                print(f"  {ev:>9} {strategy:>10}: excess {exc:8.0f} ms  ({run.wall_s:.0f} s)", flush=True)
            plots[f"{ev} of rank {SLOW_RANK} at step {event}"] = {
                "reference_ms": ref, "step_ms": series, "event_step": event, "placements": timelines}
    print_table(
        "Reaction (4 ranks; steps until within 10% of the moving oracle; excess over it, ms)",
        ["event", "strategy", "steps to 10%", "measured", "excess ms", "excess ms/step", "final ms",
         "oracle ms"],
        [[r.event, r.strategy, r.steps_to_within_10pct, r.steps_to_within_10pct_measured, r.excess_ms,
          r.excess_ms_per_step, r.steady_after_ms, r.reference_end_ms] for r in rows],
    )
    payload = {
        "config": {"steps": steps, "event_step": event, "slow_rank": SLOW_RANK,
                   "global_batch_size": global_batch_size, "per_sample_ms": per_sample_ms,
                   "fixed_ms": fixed_ms, "drift_pct_per_step": drift_pct,
                   "overhead_ms": round(overhead, 2)},
        "rows": [asdict(r) for r in rows],
        "series": plots,
    }
    write_json(out_dir / f"{name}.json", payload)
    if plot:
        from bench._plots import plot_reaction

        plot_reaction(plots, out_dir / f"{name}.png")
    return payload


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="smoke-test size")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.tiny:
        run_reaction(steps=30, event=10, strategies=("uniform",), events=("slowdown",), out_dir=args.out)
    elif args.quick:
        run_reaction(**QUICK, out_dir=args.out)
    else:
        run_reaction(out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

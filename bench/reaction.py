"""Reaction: how fast a strategy follows when a rank's speed changes during the run.

Real 4-rank torchrun/gloo CPU jobs (trainer_hook.demo_worker), all ranks equally fast at
first, in ``auto`` mode from no knowledge. Each case is an event:

- ``slowdown[:RANK:FACTOR[:B]]``: RANK becomes FACTOR x slower at step ``event``
  (default rank 3, 2x, the run's global batch);
- ``drift``: rank 3 gets slower by 1% of its original time every step from step ``event``
  (linear, 2x after 100 steps);
- ``equal``: nothing happens (equal ranks, real CPU timing noise): any proposal is churn.

The reference is the moving oracle: the exact best split's step time for the true costs
at each step (the product's solver on the injected costs) plus the fixed overhead the
split cannot change (sync, framework), measured once as an oracle run's steady step time
minus its model step time. Reported per case and strategy: steps after the event until the
split in force stays within 10% of the moving oracle's model step time (from the placement
timeline; noise-free), the same judged from measured step times (90% of rolling medians
of 10 steps within 10% of the reference), the excess time paid over the reference from the
event to the end of the run (uniform shows what doing nothing costs), the same by the
model from the placement timeline (noise-free: on a loaded machine the measured excess
mostly counts the machine's wobble), placements applied and rollbacks.

    python -m bench.reaction [--quick | --tiny | --cases [--only EVENT ...]] [--lookahead N]
    python -m bench.reaction --cases --only drift --lookahead 1   # the drift case alone
    python -m bench.reaction --cases --only slowdown:3:2 --per-sample-ms 8 --busy 2   # long steps, loaded
    python -m bench.reaction --sim      # the closed-loop simulator (bench/reaction_sim.py)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench._analysis import (
    excess_ms,
    model_step_ms,
    oracle_shares,
    split_excess_ms,
    steady_ms,
    steps_until_split_within,
    steps_until_within,
)
from bench._backend import running_backend, stop_on_sigterm
from bench._jobs import JobSpec, run_job
from bench._load import busy_loops
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
    rollbacks: int = 0
    global_batch_size: int = 64
    excess_ms_split: float | None = None  # the same by the model, from the placement timeline
    # The same reaction in seconds: the measured step times from the event to that step.
    seconds_to_within_10pct: float | None = None
    step_ms_before_event: float | None = None  # median measured step before the event: short or long steps


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


# The issue-13 cases: slowdowns of 1.5x, 2x and 4x at several ranks and batch sizes (profiled,
# the default), the 1%/step drift under every strategy, and equal ranks for churn.
CASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("slowdown:3:1.5", ("profiled",)), ("slowdown:3:2", ("profiled",)),
    ("slowdown:3:4", ("profiled",)), ("slowdown:0:2", ("profiled",)),
    ("slowdown:3:2:128", ("profiled",)), ("slowdown:1:4:128", ("profiled",)),
    ("drift", ("uniform", "profiled", "predictive")), ("equal", ("profiled",)),
)


def event_spec(ev: str, event: int, drift_pct: float, global_batch_size: int) -> tuple[dict[str, str], int, str]:
    """JobSpec fields, global batch and a title for an event name (see the module doc)."""
    parts = ev.split(":")
    if parts[0] == "slowdown":
        rank = int(parts[1]) if len(parts) > 1 else SLOW_RANK
        factor = float(parts[2]) if len(parts) > 2 else 2.0
        b = int(parts[3]) if len(parts) > 3 else global_batch_size
        return ({"slowdown": f"{rank}:{event}:{factor:g}"}, b,
                f"{factor:g}x slowdown of rank {rank} at step {event}, B={b}")
    if parts[0] == "drift":
        return ({"drift": f"{SLOW_RANK}:{event}:{drift_pct:g}"}, global_batch_size,
                f"drift {drift_pct:g}%/step of rank {SLOW_RANK} from step {event}")
    if parts[0] == "equal":
        return {}, global_batch_size, "equal ranks (churn check)"
    raise ValueError(f"unknown event {ev!r}; expected slowdown[:RANK:FACTOR[:B]], drift or equal.")


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
    cases: tuple[tuple[str, tuple[str, ...]], ...] | None = None, lookahead: int | None = None,
    busy: int = 0,
) -> dict[str, Any]:
    """Run each event under each strategy (or each of ``cases``: event, its strategies);
    write ``<name>.json`` and ``<name>.png``. ``busy`` processes spin on the CPUs meanwhile
    (a loaded machine)."""
    plan = cases if cases is not None else tuple((ev, strategies) for ev in events)
    rows: list[ReactionRow] = []
    plots: dict[str, dict[str, Any]] = {}
    base = dict(speeds=SPEEDS, per_sample_ms=per_sample_ms, fixed_ms=fixed_ms, lookahead=lookahead)
    with tempfile.TemporaryDirectory(prefix="rb-react-") as tmp, running_backend(Path(tmp)) as backend, \
            busy_loops(busy):
        overheads: dict[int, float] = {}

        def overhead_for(b: int) -> float:
            # Overhead the split cannot remove: an oracle run of the starting speeds.
            if b not in overheads:
                oracle_spec = JobSpec(job=f"react-oracle-{b}", steps=max(40, min(60, steps // 3)),
                                      global_batch_size=b, **base)  # type: ignore[arg-type]
                oracle_run = run_job(backend, oracle_spec, "oracle")
                model0 = model_step_ms(oracle_spec.a_ms, oracle_spec.c_ms,
                                       oracle_shares(oracle_spec.a_ms, oracle_spec.c_ms, b))
                overheads[b] = max(0.0, steady_ms(oracle_run.step_ms) - model0)
                print(f"  overhead outside the split (B={b}): {overheads[b]:.1f} ms (oracle run "
                      f"steady {steady_ms(oracle_run.step_ms):.1f} ms, model {model0:.1f} ms)", flush=True)
            return overheads[b]

        for ev, ev_strategies in plan:
            what, b, title = event_spec(ev, event, drift_pct, global_batch_size)
            overhead = overhead_for(b)
            series: dict[str, list[float]] = {}
            timelines: dict[str, list[dict[str, Any]]] = {}
            ref: list[float] = []
            for strategy in ev_strategies:
                tag = ev.replace(":", "-").replace(".", "p")
                spec = JobSpec(job=f"react-{tag}-{strategy}", steps=steps, global_batch_size=b,
                               **base, **what)  # type: ignore[arg-type]
                run = run_job(backend, spec, strategy)
                ref = _reference(spec, overhead)
                n = min(len(run.step_ms), len(ref))
                ys, r = run.step_ms[:n], ref[:n]
                exc = excess_ms(ys, lambda k, r=r: r[k], start=event)
                within = steps_until_split_within(run.placements, lambda k, spec=spec: cost_at(spec, k), n, b, 0.10,
                                                  start=event)
                rolled = sum(1 for p in run.backend_placements if p.get("source") == "rollback")
                rows.append(ReactionRow(
                    event=ev, strategy=strategy,
                    steps_to_within_10pct=within,
                    steps_to_within_10pct_measured=steps_until_within(
                        ys, lambda k, r=r: r[k], 0.10, start=event),
                    excess_ms=round(exc, 1), excess_ms_per_step=round(exc / max(1, n - event), 2),
                    steady_after_ms=round(steady_ms(ys, 0.15, 10), 2), reference_end_ms=round(r[-1], 2),
                    placements_applied=max(0, len(run.placements) - 1),
                    notes=[n for n in run.notes if "applied by hand" not in n],
                    rollbacks=rolled, global_batch_size=b,
                    excess_ms_split=round(split_excess_ms(
                        run.placements, lambda k, spec=spec: cost_at(spec, k), n, b, start=event), 1),
                    seconds_to_within_10pct=(round(sum(ys[event:event + within]) / 1000.0, 2)
                                             if within is not None else None),
                    step_ms_before_event=round(statistics.median(ys[max(0, event - 20):event]), 1) if event else None,
                ))
                series[strategy] = ys
                timelines[strategy] = run.placements
                print(f"  {ev:>16} {strategy:>10}: excess {exc:8.0f} ms, "
                      f"{max(0, len(run.placements) - 1)} placements ({run.wall_s:.0f} s)", flush=True)
            plots[title] = {"reference_ms": ref, "step_ms": series, "event_step": event,
                            "placements": timelines}
    print_table(
        "Reaction (4 ranks; steps until within 10% of the moving oracle; excess over it, ms)",
        ["event", "strategy", "step ms before", "steps to 10%", "seconds", "measured", "excess ms",
         "excess ms (split)", "excess ms/step", "final ms", "oracle ms", "placements", "rollbacks"],
        [[r.event, r.strategy, r.step_ms_before_event, r.steps_to_within_10pct, r.seconds_to_within_10pct,
          r.steps_to_within_10pct_measured, r.excess_ms, r.excess_ms_split, r.excess_ms_per_step,
          r.steady_after_ms, r.reference_end_ms, r.placements_applied, r.rollbacks] for r in rows],
    )
    payload = {
        "config": {"steps": steps, "event_step": event, "slow_rank": SLOW_RANK,
                   "global_batch_size": global_batch_size, "per_sample_ms": per_sample_ms,
                   "fixed_ms": fixed_ms, "drift_pct_per_step": drift_pct, "lookahead": lookahead, "busy": busy,
                   "overhead_ms": {str(k): round(v, 2) for k, v in overheads.items()}},
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
    ap.add_argument("--cases", action="store_true",
                    help="every slowdown factor, rank and batch size, drift and equal ranks")
    ap.add_argument("--only", action="append", default=None, metavar="EVENT",
                    help="with --cases: run only these cases (repeatable), e.g. drift, equal, slowdown:3:2")
    ap.add_argument("--sim", action="store_true",
                    help="the closed-loop simulator instead of real jobs (a minute or two, no backend)")
    ap.add_argument("--lookahead", type=int, default=None, help="HookConfig.lookahead of the jobs")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--event", type=int, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--per-sample-ms", type=float, default=2.0,
                    help="injected compute per sample at speed 1 (2: ~45 ms steps at B 64; 8: ~150 ms)")
    ap.add_argument("--fixed-ms", type=float, default=2.0, help="injected compute per step")
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes beside the jobs (a loaded machine)")
    ap.add_argument("--name", default=None, help="results file name (without .json) instead of the one made up")
    args = ap.parse_args(argv)
    job = {"per_sample_ms": args.per_sample_ms, "fixed_ms": args.fixed_ms, "busy": args.busy}
    suffix = (f"_{args.per_sample_ms:g}ms" if args.per_sample_ms != 2.0 else "") + (
        f"_busy{args.busy}" if args.busy else "")
    cases = CASES
    if args.only:
        cases = tuple(c for c in CASES if c[0] in args.only)
        unknown = sorted(set(args.only) - {c[0] for c in cases})
        if unknown or not args.cases:
            ap.error(f"--only takes case names of --cases ({', '.join(c[0] for c in CASES)}); "
                     f"got {', '.join(unknown) or 'no --cases'}.")
    if args.sim:
        from bench import reaction_sim

        return reaction_sim.main(["--out", str(args.out / "reaction_sim.json")])
    if args.tiny:
        run_reaction(steps=30, event=10, strategies=("uniform",), events=("slowdown",), out_dir=args.out,
                     lookahead=args.lookahead, name="reaction" + suffix, **job)
    elif args.quick:
        run_reaction(**QUICK, out_dir=args.out, lookahead=args.lookahead, name="reaction" + suffix, **job)
    elif args.cases:
        name = args.name or ("reaction_cases" if cases == CASES else "reaction_" + "_".join(
            ev.replace(":", "-").replace(".", "p") for ev, _ in cases)) + suffix
        run_reaction(steps=args.steps or 150, event=args.event or 60, cases=cases,
                     out_dir=args.out, name=name, lookahead=args.lookahead, **job)
    else:
        run_reaction(out_dir=args.out, lookahead=args.lookahead, name="reaction" + suffix, **job)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

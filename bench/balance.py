"""Balance efficiency on real jobs: how close each strategy gets to the best possible split.

Each scenario is a real 4-rank torchrun/gloo CPU DDP job (trainer_hook.demo_worker) whose
ranks have injected per-sample speeds; each runs once per strategy against one backend:

- uniform: the version-0 split, job in ``observe`` mode (what plain DDP does);
- static: the static strategy's split (weighted by relative device power) when told each
  rank's power = its injected speed. The demo ranks all report device type CPU, so the
  backend's device table cannot tell them apart; the split is computed with the product's
  ``static_shares`` and applied by hand as soon as the job registers;
- profiled / predictive: the strategy in ``auto`` mode, starting from no knowledge;
- oracle: the exact best split for the true speeds (the product's solver on the injected
  costs), applied by hand as soon as the job registers.

Reported: steady-state step time (median of the last 30% of steps), efficiency =
oracle steady / achieved steady (target >= 0.95), and steps until the rolling median of
10 steps stays within 5% of the oracle's steady step time (target <= 30).
"Steps to 5%" reads the placement timeline: the first batch from which the split in force
is, for good, within 5% of the best split's model step time for the true costs (noise-free:
it measures the policy, not the machine). "measured" is the same from the measured step
times: the first step from which 90% of the rolling medians of 10 steps are within 5% of
the oracle run's steady step time. "proposed at" (rank 0's batch index when the backend
made its first policy proposal) and "steps used" (valid steps per rank behind it) say where
the steps to 5% went: readiness and reporting before it, the lockstep exchange after it.

    python -m bench.balance [--quick | --tiny] [--steps N]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench._analysis import (
    model_step_ms,
    oracle_shares,
    steady_ms,
    steps_until_split_within,
    steps_until_within,
)
from bench._backend import Backend, running_backend, stop_on_sigterm
from bench._jobs import JobRun, JobSpec, run_job
from bench._report import RESULTS_DIR, print_table, write_json

__all__ = ["SCENARIOS", "BalanceRow", "run_balance", "main"]

SCENARIOS: dict[str, tuple[float, ...]] = {
    "1,1,1,1": (1.0, 1.0, 1.0, 1.0),
    "1,1,0.5,0.5": (1.0, 1.0, 0.5, 0.5),
    "1,1,0.5,0.25": (1.0, 1.0, 0.5, 0.25),
    "1,0.8,0.6,0.4": (1.0, 0.8, 0.6, 0.4),
}
STRATEGY_ORDER = ("uniform", "static", "profiled", "predictive", "oracle")
QUICK: dict[str, Any] = {"scenarios": {"1,1,0.5,0.25": SCENARIOS["1,1,0.5,0.25"]}, "steps": 60,
                         "strategies": ("uniform", "profiled", "predictive", "oracle")}


@dataclass
class BalanceRow:
    scenario: str
    strategy: str
    steady_ms: float
    oracle_ms: float
    efficiency: float  # oracle_ms / steady_ms
    steps_to_within_5pct: int | None  # split in force within 5% of the oracle's (model), for good
    steps_to_within_5pct_measured: int | None  # rolling median step time settles within 5%
    model_oracle_ms: float  # slowest rank's injected compute under the oracle split
    # Where the steps to 5% went: rank 0's batch index when the backend made its first
    # policy proposal, and how many valid steps of each rank that proposal was fitted on.
    first_proposal_batch: int | None
    first_proposal_steps_used: list[int] | None
    final_shares: list[int] | None
    placements_applied: int
    wall_s: float
    notes: list[str]  # retries, a crash at teardown: anything that was not a clean run


def _final_shares(run: JobRun) -> list[int] | None:
    if run.placements:
        return list(run.placements[-1].get("shares", [])) or None
    return None


def _first_proposal(run: JobRun) -> tuple[int | None, list[int] | None]:
    for p in run.proposals:
        if p.get("source") == "policy" and p.get("created_at") is not None:
            ranks = (p.get("explanation") or {}).get("ranks") or []
            return run.batch_at(float(p["created_at"])), [int(r.get("n_steps", 0)) for r in ranks] or None
    return None, None


def _row(scenario: str, run: JobRun, oracle_ms: float) -> BalanceRow:
    s = steady_ms(run.step_ms)
    proposed_at, steps_used = _first_proposal(run)
    spec = run.spec
    model = model_step_ms(spec.a_ms, spec.c_ms, oracle_shares(spec.a_ms, spec.c_ms, spec.global_batch_size))
    return BalanceRow(
        scenario=scenario, strategy=run.strategy, steady_ms=round(s, 2), oracle_ms=round(oracle_ms, 2),
        efficiency=round(oracle_ms / s, 3),
        steps_to_within_5pct=steps_until_split_within(
            run.placements, lambda _k: (spec.a_ms, spec.c_ms), len(run.step_ms),
            spec.global_batch_size, 0.05),
        steps_to_within_5pct_measured=steps_until_within(run.step_ms, oracle_ms, 0.05),
        model_oracle_ms=round(model, 2), first_proposal_batch=proposed_at,
        first_proposal_steps_used=steps_used, final_shares=_final_shares(run),
        placements_applied=max(0, len(run.placements) - 1), wall_s=round(run.wall_s, 1),
        notes=[n for n in run.notes if "applied by hand" not in n],
    )


def run_balance(
    scenarios: dict[str, tuple[float, ...]] | None = None, *, steps: int = 150,
    strategies: tuple[str, ...] = STRATEGY_ORDER, out_dir: Path = RESULTS_DIR,
    name: str = "balance", plot: bool = True, global_batch_size: int = 64,
    per_sample_ms: float = 2.0, fixed_ms: float = 2.0, backend: Backend | None = None,
    wrap: str = "ddp",
) -> dict[str, Any]:
    """Run every scenario under every strategy against one backend (a fresh one unless
    ``backend`` is given); write ``<name>.json`` and ``<name>.png``."""
    scenarios = scenarios or SCENARIOS
    rows: list[BalanceRow] = []
    series: dict[str, dict[str, list[float]]] = {}
    timelines: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with contextlib.ExitStack() as stack:
        if backend is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="rb-bal-"))
            backend = stack.enter_context(running_backend(Path(tmp)))
        for si, (label, speeds) in enumerate(scenarios.items()):
            runs: dict[str, JobRun] = {}
            for strategy in strategies:
                spec = JobSpec(
                    job=f"bal{si}-{strategy}", speeds=speeds, steps=steps,
                    global_batch_size=global_batch_size, per_sample_ms=per_sample_ms,
                    fixed_ms=fixed_ms, wrap=wrap,
                )
                runs[strategy] = run_job(backend, spec, strategy)
                print(f"  {label:>14} {strategy:>10}: steady {steady_ms(runs[strategy].step_ms):7.1f} ms"
                      f"  ({runs[strategy].wall_s:.0f} s)", flush=True)
            oracle_ms = steady_ms(runs["oracle"].step_ms) if "oracle" in runs else _model_ref(spec)
            rows += [_row(label, runs[s], oracle_ms) for s in strategies]
            series[label] = {s: runs[s].step_ms for s in strategies}
            timelines[label] = {s: runs[s].placements for s in strategies}
    print_table(
        f"Balance efficiency (4 ranks, B={global_batch_size}, {per_sample_ms:g} ms/sample at speed 1, "
        f"{fixed_ms:g} ms fixed; oracle/achieved, target >= 0.95)",
        ["speeds", "strategy", "steady ms", "oracle ms", "efficiency", "steps to 5%",
         "measured", "proposed at", "steps used", "final shares"],
        [[r.scenario, r.strategy, r.steady_ms, r.oracle_ms, r.efficiency,
          r.steps_to_within_5pct, r.steps_to_within_5pct_measured, r.first_proposal_batch,
          r.first_proposal_steps_used, r.final_shares] for r in rows],
    )
    payload = {
        "config": {"steps": steps, "global_batch_size": global_batch_size,
                   "per_sample_ms": per_sample_ms, "fixed_ms": fixed_ms, "world_size": 4, "wrap": wrap},
        "rows": [asdict(r) for r in rows],
        "step_ms": series,
        "placements": timelines,
    }
    write_json(out_dir / f"{name}.json", payload)
    if plot:
        from bench._plots import plot_balance

        plot_balance(rows, series, out_dir / f"{name}.png")
    return payload


def _model_ref(spec: JobSpec) -> float:
    return model_step_ms(spec.a_ms, spec.c_ms, oracle_shares(spec.a_ms, spec.c_ms, spec.global_batch_size))


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="smoke-test size")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    scenarios: dict[str, tuple[float, ...]] = dict(SCENARIOS)
    steps = 150
    strategies = STRATEGY_ORDER
    if args.quick:
        scenarios, steps, strategies = QUICK["scenarios"], QUICK["steps"], QUICK["strategies"]
    if args.tiny:
        scenarios = {"1,1,0.5,0.25": SCENARIOS["1,1,0.5,0.25"]}
        steps, strategies = 20, ("uniform", "oracle")
    run_balance(scenarios, steps=args.steps or steps, strategies=strategies, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Policy benchmark: solver speed, and strategies against the oracle in the simulator.

- Solve time (median of repeats) at 8, 1,000 and 10,000 ranks, random costs, B = 32 per
  rank, with and without constraints (granularity 8, caps, drains); target under 20 ms
  at 10,000 ranks. Also the time of one ``decide`` call per strategy at 8 and 64 ranks.
- In the seeded simulator (backend.policy.JobSimulator), mean step time over the oracle's
  (the exact split for the true costs, same noise draws) for uniform, static, profiled and
  predictive on five scenarios: static_mix, sudden_slowdown, thermal_drift, noisy_rank and
  memory_caps. Reported over the whole run and after step 40 (once warm-up is over). In
  memory_caps two fast ranks have small cards: the oracle is the capped oracle (best split
  under the true memory caps), and a run whose policy sees no memory (an old hook) shows
  how many steps would have run a card out of memory.

    python -m bench.policy [--quick] [--out bench/results]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from backend.policy import (
    SCENARIOS,
    Constraints,
    JobObservation,
    JobSimulator,
    PolicyConfig,
    RankObservation,
    SimRank,
    StepSample,
    decide,
    solve,
)
from bench._report import RESULTS_DIR, print_table, write_json

__all__ = ["time_solve", "time_decide", "simulate", "run_policy", "main"]

STRATEGIES = (None, "static", "profiled", "predictive")
WARM_STEP = 40


def time_solve(n: int, repeats: int, constrained: bool = False, seed: int = 0) -> dict[str, Any]:
    """Median and min wall time of ``solve`` for ``n`` ranks with random costs."""
    rnd = random.Random(seed)
    a = [rnd.uniform(1.0, 10.0) for _ in range(n)]
    c = [rnd.uniform(0.1, 3.0) for _ in range(n)]
    b_total = 32 * n + (3 if constrained else 0)  # a remainder to place when constrained
    cons = Constraints()
    if constrained:
        cons = Constraints(granularity=8, caps={r: 40 for r in range(0, n, 5)},
                           drains=frozenset(range(3, n, 11)))
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        shares = solve(a, c, b_total, cons)
        cpu.append((time.process_time() - c0) * 1000.0)
        wall.append((time.perf_counter() - t0) * 1000.0)
    if sum(shares) != b_total:
        raise RuntimeError(f"solve returned {sum(shares)} samples, expected {b_total}")
    # CPU time is what the solver costs; wall time also counts other processes on a
    # shared machine.
    return {"ranks": n, "constrained": constrained, "repeats": repeats,
            "median_ms": statistics.median(wall), "min_ms": min(wall),
            "cpu_median_ms": statistics.median(cpu)}


def time_decide(n: int, strategy: str, repeats: int) -> dict[str, Any]:
    """Median CPU time of one ``decide`` call on a simulated job of ``n`` ranks."""
    ranks = [SimRank(3.0, 0.5 + (i % 4) * 0.3, "A100-80GB") for i in range(n)]
    sim = JobSimulator(ranks, 32 * n, seed=1)
    # The uniform run's measured steps (noise-free here) make the observation.
    res = sim.run(None, 100)
    obs = JobObservation(
        job="bench", world_size=n, global_batch_size=32 * n, batch_index=99,
        shares=res.shares[-1], placement_version=1, steps_since_change=100,
        ranks=tuple(RankObservation(rank=i, device_type="A100-80GB", steps=tuple(
            StepSample(k, res.shares[k][i], ranks[i].a_ms + ranks[i].c_ms * res.shares[k][i])
            for k in range(100))) for i in range(n)))
    cfg = PolicyConfig(strategy=strategy)
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        decide(obs, cfg)
        times.append((time.process_time() - c0) * 1000.0)
    return {"ranks": n, "strategy": strategy, "median_ms": statistics.median(times)}


def simulate(steps: int, seeds: list[int]) -> list[dict[str, Any]]:
    """Mean step time over the oracle per scenario and strategy, averaged over seeds."""
    rows = []
    for scenario in SCENARIOS:
        for strategy in STRATEGIES:
            rows.append(_sim_row(scenario, strategy, steps, seeds))
    # Memory caps matter: the same job with a policy that sees no memory.
    rows.append(_sim_row("memory_caps", "profiled", steps, seeds, measure_memory=False))
    return rows


def _sim_row(scenario: str, strategy: str | None, steps: int, seeds: list[int],
             measure_memory: bool = True) -> dict[str, Any]:
    full, warm, proposals, ooms = [], [], [], []
    for seed in seeds:
        sim = JobSimulator.scenario(scenario, seed=seed, measure_memory=measure_memory)
        res = sim.run(strategy, steps)
        full.append(res.ratio())
        warm.append(res.ratio(WARM_STEP))
        proposals.append(len(res.proposals))
        ooms.append(res.oom_steps)
    name = (strategy or "uniform") + ("" if measure_memory else " (memory unmeasured)")
    return {"scenario": scenario, "strategy": name,
            "ratio": statistics.mean(full), "ratio_after_warmup": statistics.mean(warm),
            "proposals": statistics.mean(proposals), "oom_steps": statistics.mean(ooms)}


def run_policy(quick: bool = False, out_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """Run everything, print the tables, write ``policy.json``; return the payload."""
    repeats = 5 if quick else 21
    solve_rows = [time_solve(n, repeats, constrained)
                  for n in (8, 1000, 10000) for constrained in (False, True)]
    print_table(f"solve time (ms, median of {repeats})",
                ["ranks", "constraints", "wall median ms", "wall min ms", "cpu median ms"],
                [[r["ranks"], "yes" if r["constrained"] else "no", f"{r['median_ms']:.2f}",
                  f"{r['min_ms']:.2f}", f"{r['cpu_median_ms']:.2f}"] for r in solve_rows])
    decide_rows = [time_decide(n, s, 3 if quick else 7)
                   for n in ((8,) if quick else (8, 64)) for s in ("static", "profiled", "predictive")]
    print_table("decide CPU time (ms, median)", ["ranks", "strategy", "median ms"],
                [[r["ranks"], r["strategy"], f"{r['median_ms']:.1f}"] for r in decide_rows])
    steps, seeds = (150, [0]) if quick else (300, [0, 1, 2])
    sim_rows = simulate(steps, seeds)
    print_table(f"simulator: mean step time / oracle ({steps} steps, seeds {seeds})",
                ["scenario", "strategy", "whole run", f"after step {WARM_STEP}", "proposals",
                 "OOM steps"],
                [[r["scenario"], r["strategy"], f"{r['ratio']:.3f}",
                  f"{r['ratio_after_warmup']:.3f}", f"{r['proposals']:.1f}",
                  f"{r['oom_steps']:.0f}"] for r in sim_rows])
    by = {(r["scenario"], r["strategy"]): r["ratio"] for r in sim_rows}
    drift_ok = by[("thermal_drift", "predictive")] < by[("thermal_drift", "profiled")]
    at_10k = next(r for r in solve_rows if r["ranks"] == 10000 and not r["constrained"])
    mem = by[("memory_caps", "profiled")]
    no_oom = all(r["oom_steps"] == 0 for r in sim_rows if "unmeasured" not in r["strategy"])
    checks = {"solve_10k_under_20ms": at_10k["cpu_median_ms"] < 20.0,
              "predictive_beats_profiled_on_drift": drift_ok,
              "memory_caps_no_oom": no_oom,
              "memory_caps_within_10pct_of_capped_oracle": mem < 1.10}
    print(f"\nchecks: {checks}", flush=True)
    payload = {"quick": quick, "solve": solve_rows, "decide": decide_rows,
               "simulator": {"steps": steps, "seeds": seeds, "rows": sim_rows},
               "checks": checks}
    write_json(out_dir / "policy.json", payload)
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, steps and seeds")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for policy.json")
    args = parser.parse_args(argv)
    run_policy(args.quick, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

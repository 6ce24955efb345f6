"""Variable-length batches (issue 23): balancing work vs. balancing sample counts.

A closed loop over the real policy (``backend.policy.decide``, default ``PolicyConfig``,
auto mode: each proposal applies ``APPLY_LAG`` steps later) and the real sampler partition
(``trainer_hook.sampler.lpt_partition``). Four ranks with speeds 1, 0.8, 0.6, 0.4 (tokens
per unit time), heavy-tailed lengths (80% chat turns of 20-200 tokens, 20% documents with a
Pareto tail to 6,000), rank i's compute ``overhead + work_i / speed_i`` with 2% log-normal
noise, a step the slowest rank. Starts from no knowledge (the uniform split). Compares the
steady step time (steps 30 to the end) with:

- oracle: the same batches partitioned by LPT on cost / true speed;
- sample-count split: shares proportional to the true speeds, contiguous slices of samples
  (what a perfect sample-count policy reaches);
- uniform: B / 4 contiguous samples a rank.

A third pair of cases makes attention's quadratic term matter: a sample of L tokens costs
``L + L^2 / QUAD_LEN`` (at 2,000 tokens the quadratic part equals the linear one), so a
6,000-token document costs 4x its length. There the sampler's cost is either the length
(``linear``) or the fitted model (``fitted``: ``backend.policy.costfit.fit_cost`` per rank
over the steps seen, each sample weighed by ``L + (b/a) L^2`` with the ranks' median b/a,
refitted every ``REFIT_EVERY`` steps), both against the oracle on the true cost.

This is a simulation of the loop, not timed processes; it runs in seconds.

``--real`` runs the first two cases through the real thing instead: a backend process in
auto mode (its defaults otherwise) and 4 torchrun/gloo ranks (``bench._tokens_worker``) with
``hook.batch_sampler(..., sample_cost=lengths)`` and a tiny DDP model, each rank sleeping
``REAL_FIXED_MS + its tokens * REAL_MS_PER_TOKEN / speed`` a step (why a sleep: see the
worker). The policy learns from the hook's measured compute times, its placements travel
the real exchange, and the sampler's LPT split is the one trained. Reported per case: the
steady (steps 30 to the end) slowest-rank injected time under the split trained (achieved)
against the oracle, the sample-count split and uniform on the same global batches, the
measured wall step time beside it (which adds the gloo all-reduce and the hook), and the
load average. Takes about two minutes.

    python -m bench.tokens            # writes bench/results/tokens.json
    python -m bench.tokens --real     # writes bench/results/tokens_real.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from backend.policy import decide
from backend.policy.costfit import fit_cost, shared_length_sq_weight
from backend.policy.types import JobObservation, PolicyConfig, Proposal, RankObservation, StepSample
from trainer_hook.sampler import lpt_partition

SPEEDS = (1.0, 0.8, 0.6, 0.4)
OVERHEAD_MS = 2.0
MS_PER_TOKEN = 0.01  # at speed 1
APPLY_LAG = 4  # steps from a proposal to the batch it starts at (exchange lag + lookahead)
STEADY_FROM = 30
QUAD_LEN = 2000.0  # the quadratic cases: a sample costs L + L^2 / QUAD_LEN
REFIT_EVERY = 10


def lengths(rng: random.Random, n: int) -> list[float]:
    return [float(rng.randint(20, 200)) if rng.random() < 0.8
            else float(min(6000, int(200 * rng.paretovariate(1.1)))) for _ in range(n)]


def _time(work: float, speed: float, rng: random.Random | None, *, fixed_ms: float = OVERHEAD_MS,
          ms_per_token: float = MS_PER_TOKEN) -> float:
    noise = math.exp(rng.gauss(0.0, 0.02)) if rng is not None else 1.0
    return (fixed_ms + work * ms_per_token / speed) * noise if work > 0 else 0.0


def _slices(costs: list[float], shares: list[int]) -> list[float]:
    out, lo = [], 0
    for s in shares:
        out.append(sum(costs[lo:lo + s]))
        lo += s
    return out


def _speed_shares(b: int) -> list[int]:
    raw = [b * s / sum(SPEEDS) for s in SPEEDS]
    shares = [int(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - shares[i], reverse=True)[: b - sum(shares)]:
        shares[i] += 1
    return shares


def _true_cost(lens: list[float], quad: bool) -> list[float]:
    return [x + x * x / QUAD_LEN for x in lens] if quad else list(lens)


def _ratio_b_over_a(fits_in: list[tuple[list[float], list[float], list[float]]]) -> tuple[float, list[Any]]:
    """The product's k: fitted over the ranks whose own fit needs the quadratic term (0 without one)."""
    fits = [fit_cost(*f) for f in fits_in]
    quad = [rows for rows, f in zip(fits_in, fits, strict=True) if f is not None and f.model == "quadratic"]
    shown = [f.as_dict() if f is not None else None for f in fits]
    return (shared_length_sq_weight(quad) if quad else 0.0), shown


def run_case(b: int, steps: int = 120, seed: int = 0, *, quad: bool = False,
             cost_model: str = "linear") -> dict[str, Any]:
    """One case; ``quad`` makes the true cost quadratic in length, ``cost_model`` says what the
    sampler weighs samples by: their length (``linear``) or the fitted model (``fitted``)."""
    rng, noise = random.Random(seed), random.Random(seed + 1)
    n = len(SPEEDS)
    ratio_ba = 0.0  # the fitted model's b/a (0: weigh by length)
    fit_shown: list[Any] = []
    fit_rows: list[tuple[list[float], list[float], list[float]]] = [([], [], []) for _ in range(n)]
    cfg = PolicyConfig(strategy="profiled")
    shares = [b // n] * n
    pending: tuple[int, list[int]] | None = None
    hist: list[list[StepSample]] = [[] for _ in range(n)]
    achieved, oracle, by_count, uniform, proposals, since, version = [], [], [], [], 0, 0, 0
    oracle_targets = [round(s * 1000) for s in SPEEDS]
    for k in range(steps):
        if pending is not None and pending[0] == k:
            shares, since, version, pending = pending[1], 0, version + 1, None
        lens = lengths(rng, b)
        true = _true_cost(lens, quad)
        if cost_model == "fitted" and k % REFIT_EVERY == 0 and k >= STEADY_FROM // 3:
            ratio_ba, fit_shown = _ratio_b_over_a(fit_rows)
        costs = [x + ratio_ba * x * x for x in lens]  # what the sampler weighs samples by
        total = sum(costs)
        parts, work = lpt_partition(costs, shares)
        t = [_time(sum(true[j] for j in parts[i]), SPEEDS[i], noise) for i in range(n)]
        for i in range(n):
            if parts[i]:
                fit_rows[i][0].append(sum(lens[j] for j in parts[i]))
                fit_rows[i][1].append(sum(lens[j] ** 2 for j in parts[i]))
                fit_rows[i][2].append(t[i])
        achieved.append(max(t))
        costs = true  # the baselines below run on the true cost
        _, ow = lpt_partition(costs, oracle_targets)
        oracle.append(max(_time(ow[i], SPEEDS[i], None) for i in range(n)))
        by_count.append(max(_time(w, s, None) for w, s in zip(_slices(costs, _speed_shares(b)), SPEEDS, strict=True)))
        uniform.append(max(_time(w, s, None) for w, s in zip(_slices(costs, [b // n] * n), SPEEDS, strict=True)))
        for i in range(n):
            if parts[i]:
                hist[i] = [*hist[i], StepSample(k, len(parts[i]), t[i], work[i], total)][-cfg.window_steps:]
        since += 1
        obs = JobObservation(job="tokens", world_size=n, global_batch_size=b, batch_index=k, shares=tuple(shares),
                             placement_version=version, steps_since_change=since,
                             ranks=tuple(RankObservation(rank=i, steps=tuple(hist[i])) for i in range(n)))
        if pending is None:
            d = decide(obs, cfg)
            if isinstance(d, Proposal):
                pending, proposals = (k + APPLY_LAG, list(d.shares)), proposals + 1
    steady = slice(STEADY_FROM, steps)
    mean = statistics.fmean

    def ratio(xs: list[float]) -> float:
        return round(mean(xs[steady]) / mean(oracle[steady]), 3)

    # The first step from which every 10-step window's mean stays within 5% of the oracle's.
    ok = [mean(achieved[j:j + 10]) <= 1.05 * mean(oracle[j:j + 10]) for j in range(steps - 9)]
    within = next((k for k in range(len(ok)) if all(ok[k:])), None)
    return {
        "global_batch_size": b, "steps": steps, "quadratic_cost": quad, "cost_model": cost_model,
        "fits": fit_shown, "fitted_b_over_a": ratio_ba, "true_b_over_a": 1 / QUAD_LEN if quad else 0.0, "speeds": list(SPEEDS), "proposals": proposals,
        "final_shares": shares, "steady_step_ms": {
            "achieved": round(mean(achieved[steady]), 3), "oracle": round(mean(oracle[steady]), 3),
            "sample_count_split": round(mean(by_count[steady]), 3), "uniform": round(mean(uniform[steady]), 3)},
        "achieved_over_oracle": ratio(achieved), "sample_count_over_oracle": ratio(by_count),
        "uniform_over_oracle": ratio(uniform), "steps_until_every_10_step_window_within_5pct": within,
        "first_steps_over_oracle": [round(a / o, 2) for a, o in zip(achieved[:30], oracle[:30], strict=True)],
    }


REAL_FIXED_MS = 2.0
REAL_MS_PER_TOKEN = 0.02  # at speed 1: B = 96 steps near 0.2 s, B = 16 near 35 ms
REAL_STEPS = 90
REAL_EPOCH_BATCHES = 40  # samples = B * this; later batches come from reshuffled epochs


def _baselines(costs: list[float], b: int) -> tuple[float, float, float]:
    """Oracle (LPT on cost / true speed), sample-count split and uniform step times for one
    global batch of sample costs, at the real runs' injected speed."""
    at = {"fixed_ms": REAL_FIXED_MS, "ms_per_token": REAL_MS_PER_TOKEN}
    _, ow = lpt_partition(costs, [round(s * 1000) for s in SPEEDS])
    n = len(SPEEDS)
    return (max(_time(ow[i], SPEEDS[i], None, **at) for i in range(n)),
            max(_time(w, s, None, **at) for w, s in zip(_slices(costs, _speed_shares(b)), SPEEDS, strict=True)),
            max(_time(w, s, None, **at) for w, s in zip(_slices(costs, [b // n] * n), SPEEDS, strict=True)))


def run_real_case(server: Any, b: int, workdir: Path, steps: int = REAL_STEPS, seed: int = 0) -> dict[str, Any]:
    """One case through a real 4-rank torchrun job and the backend at ``server``."""
    from bench._launch import launch, torchrun_cmd
    from trainer_hook.placement import PlacementSchedule
    from trainer_hook.sampler import RebalanceBatchSampler

    n_samples = b * REAL_EPOCH_BATCHES
    result = workdir / f"tokens-real-{b}.json"
    target = ["-m", "bench._tokens_worker", "--server", server.url, "--job", f"tokens-real-{b}",
              "--steps", str(steps), "--global-batch-size", str(b), "--samples", str(n_samples),
              "--speeds", ",".join(f"{s:g}" for s in SPEEDS), "--ms-per-token", f"{REAL_MS_PER_TOKEN:g}",
              "--fixed-ms", f"{REAL_FIXED_MS:g}", "--seed", str(seed), "--result", str(result)]
    load_before = os.getloadavg()
    run = launch(torchrun_cmd(len(SPEEDS), target), timeout=600, log_path=workdir / f"tokens-real-{b}.log")
    load_after = os.getloadavg()
    if run.returncode != 0 or not result.exists():
        raise RuntimeError(f"the job with B={b} failed ({run.returncode}, hung={run.hung}):\n{run.output[-3000:]}")
    data = json.loads(result.read_text())
    recs = data["records"]
    # What the backend sent and why (the policy's proposals, a rollback, a cost model), oldest first.
    sent = [{k: p[k] for k in ("version", "shares", "source", "reason", "effective_batch_index")}
            for p in reversed(server.get(f"/api/v1/jobs/tokens-real-{b}/placements")["data"])]
    lens = lengths(random.Random(seed), n_samples)
    order = RebalanceBatchSampler(n_samples, schedule=PlacementSchedule(len(SPEEDS), b), rank=0, seed=seed)
    achieved, wall, oracle, by_count, uniform = [], [], [], [], []
    for k in range(steps):
        rows = [next(r for r in rank if r["batch_index"] == k) for rank in recs]
        achieved.append(max(r["injected_ms"] for r in rows))
        wall.append(rows[0]["step_ms"])
        o, c, u = _baselines([lens[i] for i in order.global_batch(k)], b)
        oracle.append(o)
        by_count.append(c)
        uniform.append(u)
    mean = statistics.fmean
    steady = slice(STEADY_FROM, steps)
    ok = [mean(achieved[j:j + 10]) <= 1.05 * mean(oracle[j:j + 10]) for j in range(steps - 9)]
    within = next((k for k in range(len(ok)) if all(ok[k:])), None)

    def ratio(xs: list[float]) -> float:
        return round(mean(xs[steady]) / mean(oracle[steady]), 3)

    return {
        "global_batch_size": b, "steps": steps, "speeds": list(SPEEDS), "samples": n_samples,
        "ms_per_token": REAL_MS_PER_TOKEN, "fixed_ms": REAL_FIXED_MS,
        "placements": data["timeline"], "placements_sent": sent,
        "steady_step_ms": {"achieved": round(mean(achieved[steady]), 3), "oracle": round(mean(oracle[steady]), 3),
                           "sample_count_split": round(mean(by_count[steady]), 3),
                           "uniform": round(mean(uniform[steady]), 3),
                           "achieved_wall_measured": round(mean(wall[steady]), 3)},
        "achieved_over_oracle": ratio(achieved), "sample_count_over_oracle": ratio(by_count),
        "uniform_over_oracle": ratio(uniform),
        "steps_until_every_10_step_window_within_5pct": within,
        "load_average_1m": [round(load_before[0], 2), round(load_after[0], 2)],
        "job_wall_s": round(run.wall_s, 1),
        "first_steps_over_oracle": [round(a / o, 2) for a, o in zip(achieved[:40], oracle[:40], strict=True)],
    }


def run_real(steps: int = REAL_STEPS, batches: tuple[int, ...] = (96, 16)) -> list[dict[str, Any]]:
    """The real cases (B = 96 and 16) against one backend in auto mode."""
    from bench._backend import running_backend, stop_on_sigterm

    stop_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="rb-tokens-") as tmp, \
            running_backend(Path(tmp), env={"REBALANCER_DEFAULT_MODE": "auto"}) as server:
        return [run_real_case(server, b, Path(tmp), steps) for b in batches]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tokens", description=__doc__.split("\n\n")[0])
    p.add_argument("--real", action="store_true", help="4 real torchrun ranks and a real backend (about 2 min)")
    p.add_argument("--steps", type=int, default=REAL_STEPS, help="steps per real case")
    p.add_argument("--batches", default="96,16", help="global batch sizes of the real cases")
    args = p.parse_args(argv)
    if args.real:
        cases = run_real(args.steps, tuple(int(v) for v in args.batches.split(",")))
        out = Path(__file__).parent / "results" / "tokens_real.json"
    else:
        cases = [run_case(96), run_case(16),
                 run_case(96, quad=True, cost_model="linear"), run_case(96, quad=True, cost_model="fitted"),
                 run_case(16, quad=True, cost_model="linear"), run_case(16, quad=True, cost_model="fitted")]
        out = Path(__file__).parent / "results" / "tokens.json"
    out.write_text(json.dumps({"cases": cases}, indent=2) + "\n")
    for c in cases:
        print(json.dumps(c))


if __name__ == "__main__":
    main()

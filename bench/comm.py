"""Communication priced: predicted vs measured step time after a split, on a
communication-heavy job and a compute-heavy one.

Each case is two real torchrun/gloo CPU DDP jobs of ``--ranks`` ranks (4 by default;
tests/trainer_hook/_comm_worker.py, a 3-layer MLP; every rank sleeps ``base`` ms per sample,
the upper half of the ranks half as long again: 1.5x slower; 16 samples a rank). The
communication-heavy case is a narrow MLP with 24 MB of ballast parameters whose gradient is
a zero tensor made once: the all-reduce, not compute, fills the step (exposed all-reduce
over half of it), and the ballast costs next to no host work, as a GPU's gradient kernels
would (a fill or an optimizer pass over it each step is CPU time four ranks share on two
cores, which a GPU job does not pay). Run 1 trains under the uniform split; its step records give the policy's
inputs: the profiled strategy's per-rank fit and the job's communication
(``backend.policy.comm.assess``). The solver's split of that fit is predicted to take
``max_i t_i(b_i) + exposed communication + the rest`` (what ``decide`` prices). Run 2 trains under
that split from its first steps; its median step after the switch is the measured one.
The prediction is ``decide``'s: the slowest rank's compute under the split, plus the
exposed communication and the rest of the last arriver's step (optimizer, framework),
which no split changes.
Also reported: the verdict and the bytes per step against the parameters' bytes.

Four ranks on this 2-core machine still share cores: once the split makes them arrive
together, their host work (the hook's gradient weighting, the zeroing, gloo's copies)
overlaps where it was staggered, and the measured step lands above the prediction by that
contention. ``--ranks 2`` gives each rank a core of its own (``bench/results/comm_2ranks.json``).

    python -m bench.comm [--steps 40] [--ranks 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from backend.policy import (
    JobObservation,
    PolicyConfig,
    RankObservation,
    StepSample,
    predicted_step_ms,
    solve,
)
from backend.policy.comm import CommStep, assess
from backend.policy.solver import NO_CONSTRAINTS
from backend.policy.strategies import get_strategy
from bench._report import RESULTS_DIR, print_table, write_json
from tests.helpers.ports import free_port

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # name: (MLP width, base ms per sample, ballast MB: parameters with a fill for a gradient)
    "communication-heavy": (32, 1.0, 24.0),
    "compute-heavy": (128, 4.0, 0.0),
}
SAMPLES_PER_RANK = 16  # the global batch is this times the ranks: B = 64 at 4 ranks


def _run(out: Path, width: int, base_ms: float, ballast_mb: float, steps: int, shares: str = "",
         ranks: int = 4) -> dict[int, Any]:
    out.mkdir(parents=True, exist_ok=True)
    slow = ",".join(str(r) for r in range(ranks // 2, ranks))  # the upper half: 1.5x slower
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "tests/trainer_hook/_comm_worker.py", "--out", str(out), "--steps", str(steps), "--width", str(width),
           "--bucket-mb", "25", "--global-batch", str(SAMPLES_PER_RANK * ranks), "--base-ms", str(base_ms),
           "--delay-ms", str(base_ms / 2), "--slow", slow, "--ballast-mb", str(ballast_mb)]
    if shares:
        cmd += ["--shares", shares]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)}


def _comm(recs: dict[int, list[dict[str, Any]]]) -> Any:
    n = len(recs)
    steps = {r: [CommStep(x["batch_index"], x["compute_ms"], x["sync_wait_ms"], x["data_wait_ms"], x["step_ms"],
                          x.get("comm_bytes"), x.get("comm_ms")) for x in rs] for r, rs in recs.items()}
    return assess("all_reduce", n, steps, window=len(next(iter(recs.values()))))


def run_case(name: str, steps: int, tmp: Path, ranks: int = 4) -> dict[str, Any]:
    width, base, ballast = CASES[name]
    uniform = _run(tmp / f"{name}-uniform", width, base, ballast, steps, ranks=ranks)
    recs = {r: d["records"][5:] for r, d in uniform.items()}
    comm = _comm(recs)
    shares = tuple(recs[r][-1]["local_batch_size"] for r in range(ranks))
    b = SAMPLES_PER_RANK * ranks
    last = recs[0][-1]["batch_index"]
    obs = JobObservation(
        job=name, world_size=ranks, global_batch_size=b, batch_index=last, shares=shares, placement_version=0,
        steps_since_change=last, comm=comm, ranks=tuple(RankObservation(rank=r, steps=tuple(
            StepSample(x["batch_index"], x["local_batch_size"], x["compute_ms"]) for x in recs[r])) for r in range(ranks)))
    est = get_strategy("profiled")(obs, PolicyConfig(strategy="profiled", min_steps=5), NO_CONSTRAINTS)
    target = solve(est.a_ms, est.c_ms, b, NO_CONSTRAINTS)
    exposed = comm.exposed_comm_ms or 0.0
    other = comm.other_ms or 0.0  # the rest of the last arriver's step (optimizer, framework)
    predicted = predicted_step_ms(est.a_ms, est.c_ms, target) + exposed + other
    split = _run(tmp / f"{name}-split", width, base, ballast, steps, ",".join(map(str, target)), ranks=ranks)
    after = {r: [x for x in d["records"] if x["placement_version"] > 0][3:] for r, d in split.items()}
    measured = statistics.median(x["step_ms"] for x in after[0])
    after_comm = _comm(after)
    param_bytes = uniform[0]["param_bytes"]
    return {
        "case": name, "ranks": ranks, "width": width, "base_ms_per_sample": base, "ballast_mb": ballast, "split": list(target),
        "uniform_step_ms": round(comm.step_ms or 0.0, 1), "verdict_uniform": comm.bound,
        "exposed_comm_ms": round(exposed, 1), "comm_share": round(comm.comm_share or 0.0, 3),
        "busbw_gbps": comm.busbw_gbps, "bytes_per_step": comm.bytes_per_step, "param_bytes": param_bytes,
        "other_ms": round(other, 1),
        "predicted_after_ms": round(predicted, 1), "predicted_compute_only_ms": round(predicted - exposed - other, 1),
        "measured_after_ms": round(measured, 1), "error": round(predicted / measured - 1.0, 3),
        "exposed_comm_after_ms": round(after_comm.exposed_comm_ms or 0.0, 1), "verdict_after": after_comm.bound,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ranks", type=int, default=4,
                   help="ranks per job (even; the upper half is 1.5x slower); 2 gives each rank a core of its own here")
    args = p.parse_args(argv)
    if args.ranks < 2 or args.ranks % 2:
        p.error(f"--ranks must be an even number >= 2, got {args.ranks}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_case(name, args.steps, Path(tmp), ranks=args.ranks) for name in CASES]
    print_table(
        f"Communication priced ({args.ranks} gloo ranks, {args.ranks // 2} of them 1.5x slower)",
        ["case", "verdict", "exposed comm", "predicted after", "measured after", "error", "bytes/param bytes"],
        [[r["case"], r["verdict_uniform"], f"{r['exposed_comm_ms']} ms ({r['comm_share']:.0%})",
          f"{r['predicted_after_ms']} ms", f"{r['measured_after_ms']} ms", f"{r['error']:+.1%}",
          f"{(r['bytes_per_step'] or 0) / r['param_bytes']:.4f}"] for r in rows])
    write_json(RESULTS_DIR / ("comm.json" if args.ranks == 4 else f"comm_{args.ranks}ranks.json"), {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

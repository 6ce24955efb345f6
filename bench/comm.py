"""Communication priced: predicted vs measured step time after a split, on a
communication-heavy job and a compute-heavy one.

Each case is two real 4-rank torchrun/gloo CPU DDP jobs (tests/trainer_hook/_comm_worker.py,
a 3-layer MLP; every rank sleeps ``base`` ms per sample, ranks 2 and 3 half as long again:
1.5x slower). The communication-heavy case is a narrow MLP with 16 MB of ballast
parameters, whose gradients cost a fill rather than a matrix product: the all-reduce, not
compute, fills the step, and the real compute that 4 ranks would share on 2 cores stays
negligible (an earlier wide-MLP case measured CPU contention, not communication). Run 1 trains under the uniform split; its step records give the policy's
inputs: the profiled strategy's per-rank fit and the job's communication
(``backend.policy.comm.assess``). The solver's split of that fit is predicted to take
``max_i t_i(b_i) + exposed communication + the rest`` (what ``decide`` prices). Run 2 trains under
that split from its first steps; its median step after the switch is the measured one.
The prediction is ``decide``'s: the slowest rank's compute under the split, plus the
exposed communication and the rest of the last arriver's step (optimizer, framework),
which no split changes.
Also reported: the verdict and the bytes per step against the parameters' bytes.

    python -m bench.comm [--steps 40]
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
    "communication-heavy": (32, 1.0, 16.0),
    "compute-heavy": (128, 4.0, 0.0),
}
B = 64


def _run(out: Path, width: int, base_ms: float, ballast_mb: float, steps: int, shares: str = "") -> dict[int, Any]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "tests/trainer_hook/_comm_worker.py", "--out", str(out), "--steps", str(steps), "--width", str(width),
           "--bucket-mb", "25", "--global-batch", str(B), "--base-ms", str(base_ms),
           "--delay-ms", str(base_ms / 2), "--slow", "2,3", "--ballast-mb", str(ballast_mb)]
    if shares:
        cmd += ["--shares", shares]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}


def _comm(recs: dict[int, list[dict[str, Any]]]) -> Any:
    steps = {r: [CommStep(x["batch_index"], x["compute_ms"], x["sync_wait_ms"], x["data_wait_ms"], x["step_ms"],
                          x.get("comm_bytes"), x.get("comm_ms")) for x in rs] for r, rs in recs.items()}
    return assess("all_reduce", 4, steps, window=len(next(iter(recs.values()))))


def run_case(name: str, steps: int, tmp: Path) -> dict[str, Any]:
    width, base, ballast = CASES[name]
    uniform = _run(tmp / f"{name}-uniform", width, base, ballast, steps)
    recs = {r: d["records"][5:] for r, d in uniform.items()}
    comm = _comm(recs)
    shares = tuple(recs[r][-1]["local_batch_size"] for r in range(4))
    last = recs[0][-1]["batch_index"]
    obs = JobObservation(
        job=name, world_size=4, global_batch_size=B, batch_index=last, shares=shares, placement_version=0,
        steps_since_change=last, comm=comm, ranks=tuple(RankObservation(rank=r, steps=tuple(
            StepSample(x["batch_index"], x["local_batch_size"], x["compute_ms"]) for x in recs[r])) for r in range(4)))
    est = get_strategy("profiled")(obs, PolicyConfig(strategy="profiled", min_steps=5), NO_CONSTRAINTS)
    target = solve(est.a_ms, est.c_ms, B, NO_CONSTRAINTS)
    exposed = comm.exposed_comm_ms or 0.0
    other = comm.other_ms or 0.0  # the rest of the last arriver's step (optimizer, framework)
    predicted = predicted_step_ms(est.a_ms, est.c_ms, target) + exposed + other
    split = _run(tmp / f"{name}-split", width, base, ballast, steps, ",".join(map(str, target)))
    after = {r: [x for x in d["records"] if x["placement_version"] > 0][3:] for r, d in split.items()}
    measured = statistics.median(x["step_ms"] for x in after[0])
    after_comm = _comm(after)
    param_bytes = uniform[0]["param_bytes"]
    return {
        "case": name, "width": width, "base_ms_per_sample": base, "ballast_mb": ballast, "split": list(target),
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
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_case(name, args.steps, Path(tmp)) for name in CASES]
    print_table(
        "Communication priced (4 gloo ranks, two 1.5x slower)",
        ["case", "verdict", "exposed comm", "predicted after", "measured after", "error", "bytes/param bytes"],
        [[r["case"], r["verdict_uniform"], f"{r['exposed_comm_ms']} ms ({r['comm_share']:.0%})",
          f"{r['predicted_after_ms']} ms", f"{r['measured_after_ms']} ms", f"{r['error']:+.1%}",
          f"{(r['bytes_per_step'] or 0) / r['param_bytes']:.4f}"] for r in rows])
    write_json(RESULTS_DIR / "comm.json", {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Streaming data in fixed-shape micro-batches (issue 41): balancing micro-batch counts.

Four CPU ranks (torchrun, gloo) each pack their own stream of documents into fixed-shape
micro-batches (2 sequences of 32 tokens) and train a small language model compiled with
``torch.compile(dynamic=False)`` inside DDP, under ``RebalanceHook(micro_batches=28)``.
Rank 3 is 2x slower (each micro-batch is a sleep of 40 ms / speed on top of the real
forward and backward; a sleep keeps the injected speed when the two cores are busy). Three
phases in one job, each measured the same way (the wall time of a step on rank 0):

- achieved: the backend in auto mode (its defaults) moves micro-batches between ranks; the
  mean of the settled steps (the last ``SETTLED`` steps);
- oracle: the best integer split of the 28 micro-batches for the true speeds (found by
  enumeration), requested at the first step, measured over the same steps;
- uniform: 7 micro-batches a rank, measured likewise.

Also the recompiles after each phase's first step (dynamo's ``unique_graphs`` counter, the
largest over ranks; target 0: shapes never change). About a minute.

    python -m bench.streaming        # writes bench/results/streaming.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

SPEEDS = (1.0, 1.0, 1.0, 0.5)
MICRO_BATCHES = 28
MB_MS = 40.0
STEPS = 100
SETTLED = 30  # the last steps of each phase


def oracle_split(m: int, speeds: tuple[float, ...]) -> list[int]:
    """The integer split of ``m`` micro-batches minimising the slowest rank's time (ties: the
    first in lexicographic order)."""
    best: tuple[float, list[int]] | None = None
    for cut in itertools.combinations(range(m + len(speeds) - 1), len(speeds) - 1):
        edges = [-1, *cut, m + len(speeds) - 1]
        counts = [edges[i + 1] - edges[i] - 1 for i in range(len(speeds))]
        t = max(k / s for k, s in zip(counts, speeds, strict=True))
        if best is None or t < best[0]:
            best = (t, counts)
    assert best is not None
    return best[1]


def run(steps: int = STEPS, backend: str = "aot_eager") -> dict[str, Any]:
    from bench._backend import running_backend, stop_on_sigterm
    from bench._launch import launch, torchrun_cmd

    stop_on_sigterm()
    oracle = oracle_split(MICRO_BATCHES, SPEEDS)
    uniform = [MICRO_BATCHES // len(SPEEDS)] * len(SPEEDS)
    phases = ["auto", "fixed:" + ",".join(map(str, oracle)), "fixed:" + ",".join(map(str, uniform))]
    with tempfile.TemporaryDirectory(prefix="rb-streaming-") as tmp, \
            running_backend(Path(tmp), env={"REBALANCER_DEFAULT_MODE": "auto"}) as server:
        result = Path(tmp) / "streaming.json"
        target = ["-m", "bench._streaming_worker", "--server", server.url, "--phases", ";".join(phases),
                  "--steps", str(steps), "--micro-batches", str(MICRO_BATCHES),
                  "--speeds", ",".join(f"{s:g}" for s in SPEEDS), "--mb-ms", f"{MB_MS:g}", "--seq", "32",
                  "--backend", backend, "--result", str(result)]
        load_before = os.getloadavg()
        job = launch(torchrun_cmd(len(SPEEDS), target), timeout=900, log_path=Path(tmp) / "streaming.log")
        load_after = os.getloadavg()
        if job.returncode != 0 or not result.exists():
            raise RuntimeError(f"the streaming job failed ({job.returncode}, hung={job.hung}):\n{job.output[-3000:]}")
        data = json.loads(result.read_text())
        sent = [{k: p[k] for k in ("version", "shares", "source", "effective_batch_index")}
                for p in reversed(server.get("/api/v1/jobs/streaming-auto/placements")["data"])]
        view = server.get("/api/v1/jobs/streaming-auto")
    by = {p["phase"]: p for p in data["phases"]}
    auto, orc, uni = by["auto"], by[phases[1]], by[phases[2]]

    def settled(p: dict[str, Any]) -> float:
        return statistics.fmean(p["wall_ms"][-SETTLED:])

    achieved, oracle_ms, uniform_ms = settled(auto), settled(orc), settled(uni)
    return {
        "speeds": list(SPEEDS), "micro_batches": MICRO_BATCHES, "micro_batch_shape": [2, 32],
        "mb_ms_at_speed_1": MB_MS, "steps": steps, "settled_steps": SETTLED, "compile_backend": backend,
        "oracle_split": oracle, "uniform_split": uniform,
        "final_split_auto": auto["shares"][-1], "placements_sent": sent,
        "share_unit_in_job_view": view.get("share_unit"),
        "settled_step_ms": {"achieved": round(achieved, 2), "oracle": round(oracle_ms, 2),
                            "uniform": round(uniform_ms, 2)},
        "achieved_over_oracle": round(achieved / oracle_ms, 3),
        "uniform_over_oracle": round(uniform_ms / oracle_ms, 3),
        "achieved_over_uniform": round(achieved / uniform_ms, 3),
        "recompiles": {p["phase"]: max(r["recompiles"] for r in p["ranks"]) for p in data["phases"]},
        "graphs_compiled_first_step": max(r["graphs"] for r in auto["ranks"]),
        "first_change_step": next((i for i, s in enumerate(auto["shares"]) if s != uniform), None),
        "load_average_1m": [round(load_before[0], 2), round(load_after[0], 2)],
        "job_wall_s": round(job.wall_s, 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.streaming", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=STEPS, help="steps per phase")
    p.add_argument("--backend", default="aot_eager", help="torch.compile backend (inductor: a C++ build per rank)")
    args = p.parse_args(argv)
    out = run(args.steps, args.backend)
    path = Path(__file__).parent / "results" / "streaming.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("settled_step_ms", "achieved_over_oracle", "uniform_over_oracle",
                                          "achieved_over_uniform", "recompiles", "oracle_split",
                                          "final_split_auto")}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Pipelines: a PP2 x DP2 job on 4 CPU ranks whose pipeline 1 runs 2x slower.

Real parts only: ``torch.distributed.pipelining`` (``Schedule1F1B``) on gloo, DDP over the
dp dim, the hook (``RebalanceHook(dp_mesh=, pp_mesh=, micro_batches=12)``) and, for the
achieved run, a real backend in ``auto`` mode deciding the micro-batch split from the
stages' measured times (bench/_pipeline_worker.py; slowness injected as the other benches
do: a delay per micro-batch in forward and backward, divided by the pipeline's speed).

1. Sweep (offline, rank 0 requests each split): every valid split (a, 12 - a) with both
   counts at least 2 (Schedule1F1B's floor for 2 stages) for ``--per-split`` steps; a split's
   time is the median of its steps after the first two (the schedule is rebuilt at a
   change). The oracle is the best split measured; uniform is (6, 6).
2. Achieved: the job from the uniform split with the backend in ``auto`` mode for
   ``--steps`` steps: its steady step time (median of the last 10 steps) against the
   oracle's and uniform's, and the step from which the rolling median of 5 steps stays
   within 5% of the oracle's. For each placement the backend applied, the stage model's
   prediction on record with it (``effect.prediction`` over REST: per pipeline and the step)
   beside the step measured: the backend's own check once the placement ran its effect
   window, the job's steady step under that split here (median of its steps after the first
   two) and the sweep's for the same split; each error is measured / predicted - 1.
3. Memory: every stage's peak saved-activation bytes (what autograd keeps for the backward,
   ``saved_tensors_hooks``) at each micro-batch count of the sweep under 1F1B, and under
   GPipe for contrast (a short offline run at counts 4, 8 and 10 on pipeline 0).

4. Heavy last stage (``--part advice``; ``all`` runs it after 1-3): a 4-layer model split
   2/2 whose layers 2 and 3 cost three times layers 0 and 1 (forward ``--layer-ms``,
   backward twice that), both pipelines alike. It runs with the backend, reads the
   stage-split advice over REST (``GET /api/v1/jobs/{job}/pipeline``), saves a checkpoint,
   restarts from it with the advised split, and compares the advice's predicted gain with
   the measured one (steady step: median after the first ``SKIP`` steps of each run).

    python -m bench.pipeline [--per-split N] [--steps N] [--part all|split|advice]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench._backend import running_backend, stop_on_sigterm
from bench._launch import launch, torchrun_cmd
from bench._report import RESULTS_DIR, print_table, write_json

M = 12
SPEEDS = "1,0.5"
WORKER = "bench/_pipeline_worker.py"


def _run(tmp: Path, name: str, args: list[str], timeout: float = 300.0) -> dict[str, Any]:
    result = tmp / f"{name}.json"
    res = launch(torchrun_cmd(4, [WORKER, "--result", str(result), "--micro-batches", str(M), "--speeds", SPEEDS,
                                  *args]), timeout=timeout, log_path=tmp / f"{name}.log")
    if res.returncode != 0 or not result.exists():
        raise RuntimeError(f"{name}: the job failed (exit {res.returncode}, hung {res.hung}):\n{res.output[-4000:]}")
    return json.loads(result.read_text())  # type: ignore[no-any-return]


SKIP = 4  # steps of a run left out of its steady time (schedule builds, first placements)


def heavy_last(tmp: Path, layer_ms: str, steps: int) -> dict[str, Any]:
    """Run the heavy-last-stage model on 2,2 with the backend, apply its advice by a restart
    from a checkpoint, measure both; the figures of the advice's check."""
    ckpt = tmp / "ckpt"
    common = ["--speeds", "1,1", "--layer-ms", layer_ms, "--steps", str(steps)]
    with running_backend(tmp) as backend:
        before = _run(tmp, "heavy-before", [*common, "--split", "2,2", "--server", backend.url, "--job",
                                            "pp-heavy-last", "--save", str(ckpt)])
    view = before["pipeline_view"] or {}
    advice = view.get("advice")
    if not advice:
        raise RuntimeError(f"no stage-split advice for the heavy-last-stage job: {view.get('advice_note')!r}")
    split = advice["layers_per_stage"]
    after = _run(tmp, "heavy-after", [*common, "--split", ",".join(map(str, split)), "--load", str(ckpt)])
    before_ms = statistics.median(s["step_ms"] for s in before["steps"][SKIP:])
    after_ms = statistics.median(s["step_ms"] for s in after["steps"][SKIP:])
    measured_gain = (before_ms - after_ms) / before_ms
    return {
        "layer_ms": layer_ms, "current_split": advice["current_layers_per_stage"], "advised_split": split,
        "module_names_per_stage": advice["module_names_per_stage"], "source": advice["source"],
        "advice_note": view.get("advice_note"), "stage_ms_before": advice["stage_ms_before"],
        "stage_ms_after": advice["stage_ms_after"],
        "rows": [{k: r.get(k) for k in ("n_microbatches", "compute_ms", "model_ms")} for r in view.get("rows", [])],
        "predicted_step_ms_before": advice["step_ms_before"], "predicted_step_ms_after": advice["step_ms_after"],
        "predicted_gain": advice["gain"], "measured_step_ms_before": before_ms, "measured_step_ms_after": after_ms,
        "measured_gain": measured_gain, "predicted_after_over_measured": advice["step_ms_after"] / after_ms,
        "step_ms_before": [s["step_ms"] for s in before["steps"]],
        "step_ms_after": [s["step_ms"] for s in after["steps"]],
    }


def _by_split(steps: list[dict[str, Any]], skip: int = 2) -> dict[tuple[int, ...], list[float]]:
    """Each split's step times, the first ``skip`` steps after each change left out."""
    out: dict[tuple[int, ...], list[float]] = {}
    prev, run = None, 0
    for s in steps:
        split = tuple(s["shares"])
        run = run + 1 if split == prev else 1
        prev = split
        if run > skip:
            out.setdefault(split, []).append(s["step_ms"])
    return out


def _checked(placements: list[dict[str, Any]], steps: list[dict[str, Any]],
             sweep: dict[tuple[int, ...], float]) -> list[dict[str, Any]]:
    """Each placement the backend applied with a stage-model prediction: predicted per
    pipeline and for the step, measured by the backend's check, by this run (its steps under
    the split after the first two) and by the sweep (the same split)."""
    out = []
    for p in sorted(placements, key=lambda p: p["version"]):
        c = (p.get("effect") or {}).get("prediction")
        if not c or c["predicted_step_ms"] is None:
            continue
        split = tuple(p["shares"])
        here = _by_split(steps).get(split, [])
        run_ms = statistics.median(here) if here else None
        pred = c["predicted_step_ms"]
        out.append({
            "version": p["version"], "split": list(split), "source": p["source"],
            "predicted_pipeline_ms": [r["predicted_ms"] for r in c["pipelines"]],
            "measured_pipeline_ms": [r["measured_ms"] for r in c["pipelines"]],
            "predicted_step_ms": pred, "rest_ms": c["rest_ms"],
            "backend_measured_step_ms": c["measured_step_ms"], "backend_error": c["error"],
            "backend_missed": c["missed"], "backend_note": c["note"],
            "run_measured_step_ms": run_ms, "run_error": run_ms / pred - 1 if run_ms is not None else None,
            "sweep_step_ms": sweep.get(split),
            "sweep_error": sweep[split] / pred - 1 if split in sweep else None,
        })
    return out


def _peaks(steps: list[dict[str, Any]], ranks: tuple[int, ...]) -> dict[int, list[int]]:
    """Per micro-batch count of pipeline 0: the peak saved bytes of each of ``ranks``."""
    out: dict[int, list[int]] = {}
    for s in steps:
        n = s["shares"][0]
        prev = out.get(n, [0] * len(ranks))
        out[n] = [max(p, s["peak_saved_bytes"][r]) for p, r in zip(prev, ranks, strict=True)]
    return dict(sorted(out.items()))


def _kib(v: list[int] | None) -> list[float | None]:
    return [None, None] if v is None else [x / 1024 for x in v]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-split", type=int, default=9)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fwd-ms", type=float, default=10.0)
    p.add_argument("--bwd-ms", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "pipeline.json")
    p.add_argument("--part", choices=("all", "split", "advice"), default="all")
    p.add_argument("--layer-ms", default="3,3,9,9", help="heavy-last-stage model: forward ms of each layer")
    p.add_argument("--advice-steps", type=int, default=24)
    p.add_argument("--advice-out", type=Path, default=RESULTS_DIR / "pipeline_advice.json")
    args = p.parse_args()
    stop_on_sigterm()
    if args.part != "split":
        with tempfile.TemporaryDirectory(prefix="rb-pipeline-") as t:
            got = heavy_last(Path(t), args.layer_ms, args.advice_steps)
        print_table("heavy last stage (layers " + args.layer_ms + " ms forward, 2x backward): advice applied by a "
                    "restart from a checkpoint", ["split", "advised", "pred_gain", "meas_gain", "pred_after_ms",
                                                  "meas_after_ms", "pred/meas after"],
                    [[",".join(map(str, got["current_split"])), ",".join(map(str, got["advised_split"])),
                      got["predicted_gain"], got["measured_gain"], got["predicted_step_ms_after"],
                      got["measured_step_ms_after"], got["predicted_after_over_measured"]]])
        write_json(args.advice_out, {"command": f"python -m bench.pipeline --part {args.part}", **got})
        print(f"\nwrote {args.advice_out}")
        if args.part == "advice":
            return
    delays = ["--fwd-ms", str(args.fwd_ms), "--bwd-ms", str(args.bwd_ms)]
    splits = [(a, M - a) for a in range(2, M - 1)]
    order = [(M // 2, M // 2)] + [s for s in splits if s != (M // 2, M // 2)]
    plan = ";".join(f"{i * args.per_split + 1}={a},{b}" for i, (a, b) in enumerate(order))
    with tempfile.TemporaryDirectory(prefix="rb-pipeline-") as t:
        tmp = Path(t)
        sweep = _run(tmp, "sweep", ["--schedule", "1f1b", "--plan", plan, "--steps",
                                    str(len(order) * args.per_split + 3), *delays])
        measured = {k: statistics.median(v) for k, v in _by_split(sweep["steps"]).items() if v}
        oracle_split, oracle_ms = min(measured.items(), key=lambda kv: kv[1])
        uniform_ms = measured[(M // 2, M // 2)]
        gpipe_plan = "1=4,8;6=8,4;11=10,2"
        gpipe = _run(tmp, "gpipe", ["--schedule", "gpipe", "--plan", gpipe_plan, "--steps", "16", *delays])
        with running_backend(tmp) as backend:
            achieved = _run(tmp, "achieved", ["--schedule", "1f1b", "--steps", str(args.steps), "--server",
                                              backend.url, *delays])
            placements = backend.get("/api/v1/jobs/pipeline-bench/placements?limit=100")["data"]
    checked = _checked(placements, achieved["steps"], measured)
    times = [s["step_ms"] for s in achieved["steps"]]
    steady = statistics.median(times[-10:])
    settled = next((i for i in range(5, len(times) + 1)
                    if all(statistics.median(times[j - 5:j]) <= 1.05 * oracle_ms for j in range(i, len(times) + 1))),
                   None)
    final = achieved["steps"][-1]["shares"]
    mem_1f1b = _peaks(sweep["steps"], (0, 2))
    mem_gpipe = _peaks(gpipe["steps"], (0, 2))
    rows = [[f"{a},{b}", ms, ms / oracle_ms] for (a, b), ms in sorted(measured.items())]
    print_table("sweep (1F1B, pipeline 1 at 0.5x): median step ms per split", ["split", "step_ms", "/ oracle"], rows)
    print_table("achieved (backend auto mode)", ["steady_ms", "oracle_ms", "achieved/oracle", "uniform/achieved",
                                                  "settled_at_step", "final_split"],
                [[steady, oracle_ms, steady / oracle_ms, uniform_ms / steady, settled, ",".join(map(str, final))]])
    print_table("stage-model prediction of each placement applied vs measured (error = measured / predicted - 1)",
                ["version", "split", "pred ms p0|p1", "pred step", "backend meas", "err", "run meas", "err",
                 "sweep", "err"],
                [[c["version"], ",".join(map(str, c["split"])),
                  " | ".join("-" if x is None else f"{x:.1f}" for x in c["predicted_pipeline_ms"]),
                  c["predicted_step_ms"], c["backend_measured_step_ms"], c["backend_error"],
                  c["run_measured_step_ms"], c["run_error"], c["sweep_step_ms"], c["sweep_error"]]
                 for c in checked])
    print_table("peak saved-activation KiB of stage 0 / stage 1 of pipeline 0, by its micro-batch count",
                ["count", "1F1B s0", "1F1B s1", "GPipe s0", "GPipe s1"],
                [[n, *_kib(mem_1f1b.get(n)), *_kib(mem_gpipe.get(n))] for n in sorted(set(mem_1f1b) | set(mem_gpipe))])
    write_json(args.out, {
        "command": "python -m bench.pipeline", "micro_batches": M, "speeds": SPEEDS,
        "fwd_ms": args.fwd_ms, "bwd_ms": args.bwd_ms, "schedule": "1f1b",
        "sweep_ms": {f"{a},{b}": ms for (a, b), ms in sorted(measured.items())},
        "oracle_split": list(oracle_split), "oracle_ms": oracle_ms, "uniform_ms": uniform_ms,
        "achieved_steady_ms": steady, "achieved_over_oracle": steady / oracle_ms,
        "uniform_over_achieved": uniform_ms / steady, "settled_at_step": settled, "final_split": final,
        "achieved_step_ms": times, "achieved_shares": [s["shares"] for s in achieved["steps"]],
        "predictions_checked": checked,
        "peak_saved_bytes_1f1b": {str(k): v for k, v in mem_1f1b.items()},
        "peak_saved_bytes_gpipe": {str(k): v for k, v in mem_gpipe.items()},
    })
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

"""The interleaved 1F1B model against measured runs: ``python -m bench.pipeline_interleaved``.

One pipeline of ``--pp`` CPU ranks (gloo, no data parallelism), each rank holding ``--v``
model stages (``ScheduleInterleaved1F1B``) or, for comparison, one stage of the same layers
(``Schedule1F1B``, v = 1). Every model stage is a Linear layer plus an injected delay per
micro-batch (``--fwd-ms`` forward, ``--bwd-ms`` backward), so a rank's work per micro-batch is
the same under both schedules. For each count the hook measures each rank's forward and
backward per micro-batch (its stage times, what it reports); the backend's model
``schedule_ms(stage_ms, m, v)`` (``backend/policy/pipeline.py``:
``T(m) = sum_s t_s / v + (m - 1/v) * max_s t_s``) predicts the schedule's run from them, and
the measured run is the slowest rank's schedule call (mean over the measured steps).
Writes ``bench/results/pipeline_interleaved.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]

RESULT = Path(__file__).resolve().parent / "results" / "pipeline_interleaved.json"


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from backend.policy.pipeline import schedule_ms
    from bench._pipeline_worker import _Delay
    from trainer_hook import RebalanceHook

    dist.init_process_group("gloo")
    p, v = args.pp, args.v
    mesh = init_device_mesh("cpu", (p, 1), mesh_dim_names=("pp", "dp"))
    rank = mesh["pp"].get_local_rank()
    fwd_s, bwd_s = args.fwd_ms / 1e3, args.bwd_ms / 1e3

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _Delay.apply(torch.tanh(self.lin(x)), fwd_s, bwd_s)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out - y).pow(2).mean()

    rows: list[dict[str, Any]] = []
    for interleaved in (True, False):
        for m in args.counts:
            torch.manual_seed(0)
            if interleaved:
                idx = [rank + i * p for i in range(v)]
                mods = [Layer() for _ in idx]
                stages: Any = [PipelineStage(mod, s, p * v, torch.device("cpu"), group=mesh["pp"].get_group())
                               for mod, s in zip(mods, idx, strict=True)]
                first, last = stages[0].is_first, stages[-1].is_last
                cls: Any = ScheduleInterleaved1F1B
                attached: Any = mods
            else:  # the same layers, one stage per rank
                mod = torch.nn.Sequential(*[Layer() for _ in range(v)])
                stages = PipelineStage(mod, rank, p, torch.device("cpu"), group=mesh["pp"].get_group())
                first, last, cls, attached = stages.is_first, stages.is_last, Schedule1F1B, mod
            dist.barrier()  # every rank done with the last hook: its groups' sockets are set up together
            hook = RebalanceHook(job="interleaved-model", micro_batches=m, dp_mesh=mesh["dp"], pp_mesh=mesh["pp"])
            hook.attach(attached)
            x, y = torch.randn(4 * m, 16), torch.randn(4 * m, 16)
            runs, stage = [], []
            for k in range(args.warmup + args.steps):
                with hook.step():
                    run = hook.pipeline_schedule(stages, cls, loss_fn=loss_fn)
                    run.step(x) if first else run.step(target=y if last else None)
                t = hook._pipeline.last if hook._pipeline is not None else None
                if t is not None and k >= args.warmup:
                    runs.append(t.schedule_ms)
                    stage.append(t.fwd_ms + t.bwd_ms)
            hook.close()
            mine = (statistics.mean(runs), statistics.median(stage))
            got: list[Any] = [None] * p
            dist.all_gather_object(got, mine, group=mesh["pp"].get_group())
            if rank == 0:
                stage_ms = [g[1] for g in got]
                vv = v if interleaved else 1
                measured = max(g[0] for g in got)
                predicted = schedule_ms(stage_ms, m, vv)
                rows.append({"schedule": "interleaved1f1b" if interleaved else "1f1b", "pp": p,
                             "stages_per_rank": vv, "m": m, "stage_ms": [round(s, 3) for s in stage_ms],
                             "measured_ms": round(measured, 2), "model_ms": round(predicted, 2),
                             "ratio": round(measured / predicted, 4),
                             "bubble_theory": round(((p - 1) / vv) / (m + (p - 1) / vv), 4)})
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--v", type=int, default=2)
    ap.add_argument("--counts", type=int, nargs="+", default=[4, 8, 12])
    ap.add_argument("--fwd-ms", type=float, default=3.0)
    ap.add_argument("--bwd-ms", type=float, default=6.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=str(RESULT))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    from bench._backend import REPO_ROOT, free_port

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    forward = [a for a in (argv if argv is not None else sys.argv[1:])]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.pp),
           "--master-port", str(free_port()), "-m", "bench.pipeline_interleaved", "--worker", *forward]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, env=env, cwd=REPO_ROOT, timeout=900)
    rows = json.loads(Path(args.out).read_text())
    print(f"{'schedule':<16}{'p':>3}{'v':>3}{'m':>4}  {'stage ms (fwd+bwd per mb)':<30}{'measured':>10}"
          f"{'model':>9}{'ratio':>7}")
    for r in rows:
        print(f"{r['schedule']:<16}{r['pp']:>3}{r['stages_per_rank']:>3}{r['m']:>4}  {str(r['stage_ms']):<30}"
              f"{r['measured_ms']:>10.1f}{r['model_ms']:>9.1f}{r['ratio']:>7.3f}")
    print(f"({time.monotonic() - t0:.0f} s; {args.out})")


if __name__ == "__main__":
    main()

"""torchrun target for pipelines (issue 40; PP2 x DP2 on 4 CPU ranks, float64, gloo).

A 4-layer model is cut into 2 stages; the mesh is ``("pp", "dp")`` = (2, 2), so pipeline
``j`` (dp index j) is ranks ``j`` (stage 0) and ``j + 2`` (stage 1), each stage wrapped in
DDP over its dp group. Step ``k`` trains micro-batches ``k*M .. k*M+M-1`` (``make``: a pure
function of the id, so the test replays them in one process); pipeline ``j`` trains the
positions ``run.micro_batches`` of them. Placements from ``--plan`` change the counts (one
drains a pipeline). ``--schedule gpipe|1f1b``, ``--wrap ddp|fsdp2`` (over the dp dim);
``--bad`` instead checks the refusals.
Writes ``rank{r}.json``: per step the shares and the ids trained (-1: a drained pipeline's
placeholders), the stage's parameters, its stage times and, on a pipeline's leader, the
pipeline fields of its records.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.helpers.configs import worker_main
from tests.trainer_hook import _exact_worker as w
from tests.trainer_hook import _sharded_worker as sw
from trainer_hook import RebalanceHook

MB_ROWS = 3
DIMS = (5, 7, 6, 4, 1)
LR = 0.05
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
V = 2  # model stages per rank under --schedule interleaved


def make(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + i)
    return (torch.randn(MB_ROWS, DIMS[0], generator=gen, dtype=torch.float64),
            torch.randn(MB_ROWS, DIMS[-1], generator=gen, dtype=torch.float64))


def build_model() -> torch.nn.Sequential:
    torch.manual_seed(11)
    layers: list[torch.nn.Module] = []
    for a, b in zip(DIMS, DIMS[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).to(torch.float64)  # 4 linear layers


def stage_part(model: torch.nn.Sequential, stage: int, n_stages: int = 2) -> torch.nn.Sequential:
    """2 stages: the first two linear layers (and their Tanh), then the rest; 4 stages
    (interleaved, stage s on rank s % 2): one linear layer (and its Tanh) each."""
    if n_stages == 4:
        return model[2 * stage:2 * stage + 2]
    return model[:4] if stage == 0 else model[4:]


def mean_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean()


def train(args: argparse.Namespace, out: str) -> None:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    if args.bad:
        return refusals(mesh, out)
    interleaved = args.schedule == "interleaved"
    n_stages = 2 * V if interleaved else 2
    indices = [pp_rank + 2 * i for i in range(V)] if interleaved else [pp_rank]
    full = build_model()
    parts = [stage_part(full, s, n_stages) for s in indices]
    models = [wrap(part, args.wrap, mesh) for part in parts]
    stages = [PipelineStage(m, s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group())
              for m, s in zip(models, indices, strict=True)]
    hook = RebalanceHook(job=f"pipe-{args.schedule}", micro_batches=args.micro_batches, exchange_every=3,
                         exchange_lag=1, dp_mesh=mesh["dp"], pp_mesh=mesh["pp"])
    hook.attach(models if interleaved else models[0])
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=LR, momentum=0.9)
    stage: object = stages if interleaved else stages[0]
    first, last = stages[0].is_first, stages[-1].is_last
    plan = w.parse_plan(args.plan)
    m = args.micro_batches
    shares, ids, times, refused = [], [], [], []
    for _ in range(args.steps):
        k = hook.batch_index
        if rank == 0 and k in plan:
            hook.request_placement(plan[k], reason=f"plan@{k}")
        if rank == 0 and k == 2 and args.schedule in ("1f1b", "interleaved"):
            try:  # 1F1B: fewer micro-batches than stages; interleaved: not a multiple of its rounds
                hook.request_placement([1, m - 1] if args.schedule == "1f1b" else [m - 5, 5], reason="refused")
            except ValueError as exc:
                refused.append(str(exc))
        with hook.step():
            run = hook.pipeline_schedule(stage, SCHEDULES[args.schedule], loss_fn=mean_loss)
            batch = [make(k * m + j) for j in run.micro_batches]
            x = torch.cat([b[0] for b in batch]) if first else None
            y = torch.cat([b[1] for b in batch]) if last else None
            if first:
                run.step(x)
            else:
                run.step(target=y)
            opt.step()
            opt.zero_grad(set_to_none=True)
        shares.append(hook.shares)
        ids.append([-1] * run.n_microbatches if run.drained else [k * m + j for j in run.micro_batches])
        t = hook._pipeline.last if hook._pipeline is not None else None
        times.append(None if t is None else [t.fwd_ms, t.bwd_ms, t.send_wait_ms, t.recv_wait_ms, t.bubble_ms,
                                              t.schedule_ms, t.micro_batches])
    hook.close()
    records = [{"batch": r.batch_index, "local": r.local_batch_size, "n_microbatches": r.n_microbatches,
                "bubble_ms": r.bubble_ms, "step_ms": r.step_ms, "compute_ms": r.compute_ms,
                "stage_fwd_ms": r.stage_fwd_ms, "stage_bwd_ms": r.stage_bwd_ms,
                "stage_recv_wait_ms": r.stage_recv_wait_ms, "stage_send_wait_ms": r.stage_send_wait_ms,
                "stage_bubble_ms": r.stage_bubble_ms} for r in hook.history]
    result = {"rank": rank, "stage": pp_rank, "shares": shares, "ids": ids, "times": times, "refused": refused,
              "records": records, "hello": hook._hello().pipeline.to_dict() if hook._hello().pipeline else None,
              "params": [p for part in parts for p in sw.full_params(part, args.wrap)],
              "stage_params": {str(s): sw.full_params(part, args.wrap) for s, part in zip(indices, parts, strict=True)}}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def wrap(part: torch.nn.Sequential, how: str, mesh: object) -> torch.nn.Module:
    """``part`` in DDP or FSDP2 over the dp dim."""
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in part:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["dp"])  # type: ignore[index]
        return fully_shard(part, mesh=mesh["dp"])  # type: ignore[index]
    return DDP(part, process_group=mesh["dp"].get_group())  # type: ignore[index]


def refusals(mesh: object, out: str) -> None:
    """Each bad input's message (every rank runs the same checks)."""
    got: dict[str, str] = {}

    def expect(name: str, fn: object) -> None:
        try:
            fn()  # type: ignore[operator]
        except (ValueError, RuntimeError) as exc:
            got[name] = str(exc)
        else:
            got[name] = "accepted"

    pp_rank = mesh["pp"].get_local_rank()  # type: ignore[index]
    expect("no_micro_batches", lambda: RebalanceHook(global_batch_size=8, dp_mesh=mesh["dp"],  # type: ignore[index]
                                                     pp_mesh=mesh["pp"]))  # type: ignore[index]
    expect("no_dp_mesh", lambda: RebalanceHook(micro_batches=8, pp_mesh=mesh["pp"]))  # type: ignore[index]
    part = stage_part(build_model(), pp_rank)
    model = DDP(part, process_group=mesh["dp"].get_group())  # type: ignore[index]
    stage = PipelineStage(model, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())  # type: ignore[index]
    dp_rank = mesh["dp"].get_local_rank()  # type: ignore[index]
    wrong_group = PipelineStage(model, dp_rank, 2, torch.device("cpu"), group=mesh["dp"].get_group())  # type: ignore[index]
    hook = RebalanceHook(micro_batches=4, dp_mesh=mesh["dp"], pp_mesh=mesh["pp"])  # type: ignore[index]
    hook.attach(model)
    with hook.step():
        expect("looped_bfs", lambda: hook.pipeline_schedule(stage, ScheduleLoopedBFS, loss_fn=mean_loss))
        expect("scale_grads", lambda: hook.pipeline_schedule(stage, ScheduleGPipe, loss_fn=mean_loss,
                                                             scale_grads=True))
        expect("wrong_group", lambda: hook.pipeline_schedule(wrong_group, ScheduleGPipe, loss_fn=mean_loss))
        expect("zero_bubble", lambda: hook.pipeline_schedule([stage], ScheduleInterleavedZeroBubble,
                                                             loss_fn=mean_loss))
        pp = mesh["pp"].get_group()  # type: ignore[index]
        swapped = [PipelineStage(model, pp_rank + 2 * i, 4, torch.device("cpu"), group=pp) for i in (1, 0)]
        expect("interleaved_order", lambda: hook.pipeline_schedule(swapped, ScheduleInterleaved1F1B,
                                                                   loss_fn=mean_loss))
        run = hook.pipeline_schedule(stage, ScheduleGPipe, loss_fn=mean_loss)
        x, y = make(0)
        xs = torch.cat([x] * run.n_microbatches)
        ys = torch.cat([y] * run.n_microbatches)
        run.step(xs) if stage.is_first else run.step(target=ys)
    hook.close()
    tp_mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    expect("tp", lambda: RebalanceHook(micro_batches=4, dp_mesh=tp_mesh["dp"], pp_mesh=tp_mesh["pp"]))
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"refused": got}, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--schedule", default="gpipe", choices=tuple(SCHEDULES))
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--micro-batches", type=int, default=6)
    p.add_argument("--plan", default="")
    p.add_argument("--wrap", default="ddp", choices=("ddp", "fsdp2"))
    p.add_argument("--bad", action="store_true")
    worker_main(p, train)


if __name__ == "__main__":
    main()

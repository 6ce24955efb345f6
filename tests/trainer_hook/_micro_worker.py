"""torchrun target for micro-batch placements (issue 41; float64, gloo).

Each rank reads its own stream of fixed-shape micro-batches (rank r the ids r, r+W, ...,
as ``split_dataset_by_node`` shards a stream); micro-batch ``i`` is a pure function of i
(``make``), so the test replays every step's micro-batches in one process. Placements
from ``--plan`` change only how many micro-batches each rank trains (one drains a rank).

``--wrap``: ``ddp``, ``fsdp2`` or ``compiled`` (``DDP(torch.compile(m, dynamic=False))``,
aot_eager); ``--loss``: ``samples`` (a per-micro-batch mean) or ``tokens`` (summed over
valid tokens times ``hook.token_loss_weight()``). Writes ``rank{r}.json``: per step the
shares and the ids trained (-1 for a drained rank's dummy), the recompiles after the first
step (compiled), and on rank 0 the final parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.helpers.configs import worker_main
from tests.trainer_hook import _exact_worker as w
from tests.trainer_hook import _sharded_worker as sw
from trainer_hook import RebalanceHook

MB_ROWS = 3  # samples in one micro-batch
SEQ = 4  # tokens per sample


def make(i: int) -> dict[str, torch.Tensor]:
    """Micro-batch ``i``: inputs, targets, a mask of valid tokens (some ignored), its id."""
    gen = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(MB_ROWS, SEQ, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(MB_ROWS, SEQ, 1, generator=gen, dtype=torch.float64)
    mask = (torch.rand(MB_ROWS, SEQ, 1, generator=gen) > 0.3).to(torch.float64)
    return {"x": x, "y": y, "mask": mask, "id": torch.tensor([i])}


def stream(rank: int, world: int) -> Iterator[dict[str, torch.Tensor]]:
    i = rank
    while True:
        yield make(i)
        i += world


def mean_loss(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(mb["x"]) - mb["y"]).pow(2).mean()


def token_loss_sum(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(mb["x"]) - mb["y"]).pow(2) * mb["mask"]).sum()


def build(how: str) -> torch.nn.Module:
    model = w.build_model()
    if how == "fsdp2":
        return sw.wrap(model, "fsdp2")
    if how == "compiled":
        return DDP(torch.compile(model, dynamic=False, backend="aot_eager"))
    return DDP(model)


def train(args: argparse.Namespace, out: str) -> None:
    started = time.process_time()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.wrap == "compiled":
        import torch._dynamo

        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    hook = RebalanceHook(job=f"micro-{args.wrap}", micro_batches=args.micro_batches, exchange_every=3,
                         exchange_lag=1)
    model = build(args.wrap)
    hook.attach(model)
    opt = w.make_optimizer(model)
    plan = w.parse_plan(args.plan)
    src = stream(rank, world)
    shares, ids = [], []
    graphs_after_first = None
    for _ in range(args.steps):
        k = hook.batch_index
        if rank == 0 and k in plan:
            hook.request_placement(plan[k], reason=f"plan@{k}")
        with hook.step():
            if args.loss == "tokens":
                mbs = hook.micro_batches(src, valid_tokens=lambda mb: mb["mask"].sum())
            else:
                mbs = hook.micro_batches(src)
            for mb in mbs:
                if args.loss == "tokens":
                    (token_loss_sum(model, mb) * hook.token_loss_weight()).backward()
                else:
                    mean_loss(model, mb).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        shares.append(hook.shares)
        ids.append([int(mb["id"]) for mb in mbs.items] if mbs.count else [-1])
        if args.wrap == "compiled" and graphs_after_first is None:
            graphs_after_first = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    hook.close()
    result: dict[str, object] = {"rank": rank, "shares": shares, "ids": ids, "gradients": hook.gradients,
                                 "cpu_s": time.process_time() - started}  # what the configuration costs CI
    if args.wrap == "compiled":
        result["recompiles"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_after_first
        result["graphs"] = graphs_after_first
    params = sw.full_params(model, "fsdp2" if args.wrap == "fsdp2" else "ddp")
    if rank == 0:
        result["params"] = params
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--wrap", default="ddp", choices=("ddp", "fsdp2", "compiled"))
    p.add_argument("--loss", default="samples", choices=("samples", "tokens"))
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--micro-batches", type=int, default=6)
    p.add_argument("--plan", default="")
    worker_main(p, train)


if __name__ == "__main__":
    main()

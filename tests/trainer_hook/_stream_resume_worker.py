"""torchrun target: stop a micro-batch job and resume it from each rank's checkpoint (issue 41).

``--source hf``: Hugging Face ``datasets`` streaming (``streaming=True``) over the local
JSON files in ``--data``, ``split_dataset_by_node``, read through torchdata's
``StatefulDataLoader`` (its state_dict resumes the stream). ``--source plain``: a plain
generator per rank (no state: the hook skips what was consumed). ``--phase first`` trains
``--steps`` steps and saves every rank's ``hook.state_dict()`` (rank 0 also the model and
optimizer); ``--phase resume`` loads them and trains ``--steps`` more. Each rank writes the
sample ids it trained per step to ``rank{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.helpers.configs import worker_main
from tests.trainer_hook import _exact_worker as w
from trainer_hook import RebalanceHook

ROWS = 2  # samples per micro-batch


def features(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50_000 + i)
    return torch.randn(5, generator=gen, dtype=torch.float64), torch.randn(1, generator=gen, dtype=torch.float64)


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    xs, ys = zip(*(features(int(r["id"])) for r in rows), strict=True)
    return {"x": torch.stack(xs), "y": torch.stack(ys), "id": torch.tensor([int(r["id"]) for r in rows])}


def hf_source(data: str, rank: int, world: int) -> Any:
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node
    from torchdata.stateful_dataloader import StatefulDataLoader

    files = sorted(os.path.join(data, f) for f in os.listdir(data) if f.endswith(".jsonl"))
    ds = load_dataset("json", data_files=files, split="train", streaming=True)
    shard = split_dataset_by_node(ds, rank=rank, world_size=world)
    return StatefulDataLoader(shard, batch_size=ROWS, collate_fn=collate, drop_last=True)


def plain_source(rank: int, world: int) -> Iterator[dict[str, torch.Tensor]]:
    i = rank * 10_000
    while True:
        yield collate([{"id": i + j} for j in range(ROWS)])
        i += ROWS


def train(args: argparse.Namespace, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = os.path.join(args.ckpt, args.source)
    os.makedirs(ckpt, exist_ok=True)
    hook = RebalanceHook(job=f"resume-{args.source}", micro_batches=args.micro_batches, exchange_every=2,
                         exchange_lag=1)
    model = DDP(w.build_model())
    hook.attach(model)
    opt = w.make_optimizer(model)
    if args.phase == "resume":
        hook.load_state_dict(torch.load(os.path.join(ckpt, f"hook{rank}.pt"), weights_only=False))
        saved = torch.load(os.path.join(ckpt, "train.pt"), weights_only=False)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    src = hf_source(args.data, rank, world) if args.source == "hf" else plain_source(rank, world)
    plan = w.parse_plan(args.plan)
    first = hook.batch_index
    ids, shares = [], []
    for _ in range(args.steps):
        k = hook.batch_index
        if rank == 0 and k in plan:
            hook.request_placement(plan[k], reason=f"plan@{k}")
        with hook.step():
            mbs = hook.micro_batches(src)
            for mb in mbs:
                torch.nn.functional.mse_loss(model(mb["x"]), mb["y"]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        ids.append([int(i) for mb in mbs.items for i in mb["id"]] if mbs.count else [])
        shares.append(hook.shares)
    state = hook.state_dict()
    torch.save(state, os.path.join(ckpt, f"hook{rank}.pt"))
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, os.path.join(ckpt, "train.pt"))
    hook.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "first_step": first, "source_state": state["stream"]["source_state"] is not None, "ids": ids, "shares": shares,
                   "params": [p.detach().tolist() for p in model.module.parameters()]}, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--data", default="")
    p.add_argument("--source", choices=("hf", "plain"), default="plain")
    p.add_argument("--phase", choices=("first", "resume"), default="first")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--plan", default="")
    worker_main(p, train)


if __name__ == "__main__":
    main()

"""torchrun target of ``python -m bench.streaming``: a packed-sequence stream trained in
fixed-shape micro-batches under micro-batch placements.

Each rank packs its own stream of documents (random lengths, its own seed) into sequences
of ``--seq`` tokens, ``--rows`` sequences a micro-batch, and trains a small compiled
language model (``torch.compile(dynamic=False)``) wrapped in DDP. Its "device" is a sleep of
``--mb-ms / speed`` per micro-batch (why a sleep: see ``bench/_tokens_worker.py``: the ranks
share two CPU cores). Phases run one after the other in one process group:

- ``auto``: the hook streams to the backend at ``--server`` (auto mode), which moves
  micro-batches between ranks;
- ``fixed:K0,K1,...``: offline, the given counts requested at the first step (the oracle
  and the uniform split, measured the same way).

Rank 0 writes per phase every step's wall time, shares and the recompiles after the first
step (dynamo's ``unique_graphs`` counter, per process: the largest over ranks) to ``--result``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_hook import RebalanceHook

VOCAB = 256
EOS = 0


def packed(rank: int, seq: int, rows: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Documents of 5 to 400 tokens, end-to-end with EOS between them, cut into micro-batches
    of ``rows`` sequences of ``seq + 1`` tokens (inputs and labels shifted by one)."""
    rng = random.Random(seed * 1000 + rank)
    buf: list[int] = []
    need = rows * (seq + 1)
    while True:
        while len(buf) < need:
            buf.extend(rng.randrange(1, VOCAB) for _ in range(rng.randint(5, 400)))
            buf.append(EOS)
        chunk = torch.tensor(buf[:need]).view(rows, seq + 1)
        del buf[:need]
        yield chunk[:, :-1], chunk[:, 1:]


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.mix = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def run_phase(args: argparse.Namespace, phase: str, speed: float) -> dict[str, Any]:
    import torch._dynamo

    rank = dist.get_rank()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fixed = None if phase == "auto" else [int(v) for v in phase.split(":", 1)[1].split(",")]
    server = args.server if phase == "auto" else None
    hook = RebalanceHook(server=server, job=f"{args.job}-{phase.replace(':', '-').replace(',', '-')}",
                         micro_batches=args.micro_batches, total_steps=args.steps)
    torch.manual_seed(0)
    model = DDP(torch.compile(TinyLM(), dynamic=False, backend=args.backend))
    hook.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stream = packed(rank, args.seq, args.rows, args.seed)
    wall, shares, compute = [], [], []
    graphs_after_first = 0
    for step in range(args.steps):
        if fixed is not None and step == 0 and rank == 0:
            hook.request_placement(fixed, reason="bench: fixed split")
        t0 = time.perf_counter()
        with hook.step():
            for ids, labels in hook.micro_batches(stream):
                time.sleep(args.mb_ms / speed / 1e3)  # the rank's device at its injected speed
                logits = model(ids)
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        wall.append((time.perf_counter() - t0) * 1e3)
        shares.append(hook.shares)
        compute.append(hook.last_step.compute_ms if hook.last_step is not None else None)
        if step == 0:
            graphs_after_first = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    recompiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_after_first
    hook.close()
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"recompiles": recompiles, "graphs": graphs_after_first, "compute_ms": compute})
    return {"phase": phase, "wall_ms": wall, "shares": shares, "ranks": per_rank}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--server", default="")
    p.add_argument("--job", default="streaming")
    p.add_argument("--phases", required=True, help="auto;fixed:8,8,8,4;... (semicolon-separated)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--micro-batches", type=int, default=28)
    p.add_argument("--speeds", default="1,1,1,0.5")
    p.add_argument("--mb-ms", type=float, default=10.0)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    speed = [float(s) for s in args.speeds.split(",")][dist.get_rank()]
    phases = [run_phase(args, phase, speed) for phase in args.phases.split(";")]
    if dist.get_rank() == 0:
        with open(args.result + ".tmp", "w") as f:
            json.dump({"phases": phases}, f)
        os.replace(args.result + ".tmp", args.result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""torchrun target for the token-mean exactness test (issue 23; float64, gloo).

Samples are short sequences of 1-6 tokens, some labels ignored; the sampler's cost is the
sequence length, so the split is a cost partition and a rank's token count varies. The
loss is the summed squared error over valid tokens times ``hook.token_loss_weight``.
``--mode comm_hook`` (DDP comm hook, a tensor count) or ``loss_scale`` (DDP's own
averaging, an int count); ``--accum`` splits each local batch in two micro-batches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from tests.trainer_hook import _exact_worker as w
from trainer_hook import RebalanceHook

N_SAMPLES = 60
MAX_LEN = 6


def length(i: int) -> int:
    return 1 + (i * 7) % MAX_LEN


class Sequences(Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(99)
        self.x = torch.randn(N_SAMPLES, MAX_LEN, 5, generator=gen, dtype=torch.float64)
        self.y = torch.randn(N_SAMPLES, MAX_LEN, 1, generator=gen, dtype=torch.float64)
        self.mask = torch.zeros(N_SAMPLES, MAX_LEN, 1, dtype=torch.float64)
        for i in range(N_SAMPLES):
            for t in range(length(i)):
                self.mask[i, t, 0] = 0.0 if (i + t) % 5 == 0 else 1.0  # ignored labels

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i], self.mask[i]


def loss_sum(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y).pow(2) * mask).sum()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--plan", default="")
    p.add_argument("--mode", choices=("comm_hook", "loss_scale"), default="comm_hook")
    p.add_argument("--accum", action="store_true")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    hook = RebalanceHook(job="tok", global_batch_size=w.GLOBAL_BATCH, exchange_every=3, exchange_lag=1, lookahead=3)
    model = DDP(w.build_model())
    hook.attach(model, gradients="loss_scale" if args.mode == "loss_scale" else "auto")
    opt = w.make_optimizer(model)
    ds = Sequences()
    loader = hook.data_loader(ds, shuffle=True, seed=5, sample_cost=[length(i) for i in range(N_SAMPLES)])
    plan = w.parse_plan(args.plan)
    shares_seen = []
    while hook.batch_index < args.steps:
        for x, y, mask in loader:
            k = hook.batch_index
            if rank == 0 and k in plan:
                hook.request_placement(plan[k], reason=f"plan@{k}")
            with hook.step():
                if args.accum:
                    n = int(mask.sum())  # a Python int: the count goes over the hook's CPU group
                    f = hook.token_loss_weight(n)
                    h = len(x) // 2
                    if h > 0:
                        with model.no_sync():
                            (loss_sum(model, x[:h], y[:h], mask[:h]) * f).backward()
                    (loss_sum(model, x[h:], y[h:], mask[h:]) * f).backward()
                else:
                    (loss_sum(model, x, y, mask) * hook.token_loss_weight(mask.sum())).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            shares_seen.append(hook.shares)
            if hook.batch_index >= args.steps:
                break
    hook.close()
    out: dict[str, object] = {"rank": rank, "shares": shares_seen, "gradients": hook.gradients}
    if rank == 0:
        out["params"] = [q.detach().tolist() for q in model.module.parameters()]
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

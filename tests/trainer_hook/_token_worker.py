"""torchrun target for the token-mean exactness test (issue 23; float64, gloo).

Samples are short sequences of 1-6 tokens, some labels ignored; the sampler's cost is the
sequence length, so the split is a cost partition and a rank's token count varies. The
loss is the summed squared error over valid tokens times ``hook.token_loss_weight``.

One launch trains several runs one after the other (``--runs``, comma-separated; a hook,
a model and a loader each), so the test pays torchrun's start once:

- ``comm_hook``: DDP's comm hook, the count a tensor;
- ``loss_scale_accum``: DDP's own averaging (``gradients="loss_scale"``), an int count,
  two micro-batches a step;
- ``fsdp2_accum``: FSDP2 (``fully_shard`` per Linear and the root), two micro-batches;
- ``compiled_accum``: ``DDP(torch.compile(model))``, two micro-batches;
- ``lengths_accum``: DDP with ``sample_length=`` instead of ``sample_cost=``: placements
  in ``--plan`` may carry a cost model (``STEP=S0,S1,S2@K``: k of L + k*L^2), so the
  samples a rank gets change mid-run with its share unchanged (``--lengths-plan``);
- ``readme_slow``: README.md's loop (the count after the forward), rank 1's forward 2x
  slower, under the uniform split (it ignores ``--plan``); it also writes the step records
  (batch, local size, compute, sync wait, work, batch work, GC ms per generation).

Each run writes ``OUT/RUN.rank{r}.json``: the shares of each step, the schedule's timeline
(with k), the number of samples each step trained and, on rank 0, the final parameters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from tests.trainer_hook import _exact_worker as w
from tests.trainer_hook import _sharded_worker as sw
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


RUNS = ("comm_hook", "loss_scale_accum", "fsdp2_accum", "compiled_accum", "lengths_accum", "readme_slow")
# readme_slow: a forward takes 1 ms per token, 2 ms on rank 1, under the uniform split (no
# --plan); 34 steps, so that the policy trusts every fit (it holds a rank with fewer than
# 3 x min_steps steps when noisy).
SLOW_RANK, S_PER_TOKEN, SLOW_STEPS = 1, 0.001, 34


def parse_plan(text: str) -> dict[int, tuple[list[int], float | None]]:
    """``STEP=S0,S1,S2[@K];...``: the shares to request at a step, with the cost model's k if given."""
    plan: dict[int, tuple[list[int], float | None]] = {}
    for item in filter(None, text.split(";")):
        step, rest = item.split("=")
        shares, _, k = rest.partition("@")
        plan[int(step)] = ([int(v) for v in shares.split(",")], float(k) if k else None)
    return plan


def build(run: str, compile_backend: str = "aot_eager") -> torch.nn.Module:
    model = w.build_model()
    if run == "fsdp2_accum":
        return sw.wrap(model, "fsdp2")
    if run == "compiled_accum":
        # aot_eager: dynamo's graphs and AOT autograd's backward, which are what DDP's
        # hooks and the loss weight see; inductor's C++ build would cost CI a minute here.
        return DDP(torch.compile(model, backend=compile_backend))
    return DDP(model)


def train(run: str, args: argparse.Namespace) -> None:
    started = time.process_time()
    rank = dist.get_rank()
    hook = RebalanceHook(job=f"tok-{run}", global_batch_size=w.GLOBAL_BATCH, exchange_every=3, exchange_lag=1,
                         lookahead=3)
    model = build(run, args.compile_backend)
    hook.attach(model, gradients="loss_scale" if run == "loss_scale_accum" else "auto")
    opt = w.make_optimizer(model)
    ds = Sequences()
    lengths = [length(i) for i in range(N_SAMPLES)]
    given = {"sample_length": lengths} if run == "lengths_accum" else {"sample_cost": lengths}
    loader = hook.data_loader(ds, shuffle=True, seed=5, **given)  # type: ignore[arg-type]
    # readme_slow trains the uniform split throughout: its test hands the policy an observation
    # of it (a plan's placement would change who waits: a drained slow rank waits, rightly).
    plan = {} if run == "readme_slow" else parse_plan(args.lengths_plan if run == "lengths_accum" else args.plan)
    how = "fsdp2" if run == "fsdp2_accum" else "ddp"
    shares_seen, sizes = [], []
    steps = SLOW_STEPS if run == "readme_slow" else args.steps
    while hook.batch_index < steps:
        for x, y, mask in loader:
            k = hook.batch_index
            if rank == 0 and k in plan:
                shares, sq = plan[k]
                hook.request_placement(shares, reason=f"plan@{k}", length_sq_weight=sq)
            with hook.step():
                if run.endswith("_accum"):
                    # The same two micro-batches on every rank (FSDP all-gathers in each
                    # forward), one possibly empty; the count covers both.
                    n: Any = int(mask.sum()) if run == "loss_scale_accum" else mask.sum()
                    f = hook.token_loss_weight(n)
                    pieces = list(zip(x.tensor_split(2), y.tensor_split(2), mask.tensor_split(2), strict=True))
                    for i, (xi, yi, mi) in enumerate(pieces):
                        with sw.no_sync(model, how, last=i == len(pieces) - 1):
                            (loss_sum(model, xi, yi, mi) * f).backward()
                elif run == "readme_slow":  # as README.md writes it: the count after the forward
                    # The forward's cost, per token: rank 1 is 2x slower.
                    time.sleep(S_PER_TOKEN * float(mask.sum()) * (2 if rank == SLOW_RANK else 1))
                    loss = loss_sum(model, x, y, mask)
                    (loss * hook.token_loss_weight(mask.sum())).backward()
                else:
                    (loss_sum(model, x, y, mask) * hook.token_loss_weight(mask.sum())).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            shares_seen.append(hook.shares)
            sizes.append(len(x))
            if hook.batch_index >= steps:
                break
    hook.close()
    out: dict[str, object] = {
        "rank": rank, "shares": shares_seen, "sizes": sizes, "gradients": hook.gradients,
        "cpu_s": time.process_time() - started,  # what the run costs CI, by rank
        "timeline": [[t.start_batch, t.version, list(t.shares), t.length_sq_weight] for t in hook.schedule.timeline()],
    }
    if run == "readme_slow":
        out["records"] = [[r.batch_index, r.local_batch_size, r.compute_ms, r.sync_wait_ms, r.work, r.batch_work, r.gc_ms]
                          for r in hook.history]
    params = sw.full_params(model, how)  # FSDP2 gathers the shards: every rank takes part
    if rank == 0:
        out["params"] = params
    with open(os.path.join(args.out, f"{run}.rank{rank}.json"), "w") as f:
        json.dump(out, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--plan", default="")
    p.add_argument("--lengths-plan", default="", help="the lengths_accum run's plan")
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--compile-backend", default="aot_eager", help="torch.compile's backend (inductor: by hand)")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    for run in args.runs.split(","):
        if run not in RUNS:
            raise SystemExit(f"unknown run {run!r}; one of {', '.join(RUNS)}")
        train(run, args)
        dist.barrier()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""torchrun target: the hook on DDP, FSDP2, FSDP1 and compiled DDP (float64, CPU, gloo).

Each rank trains ``--steps`` global batches under the placements in ``--plan`` (requested
on rank 0), with ``--accum`` micro-batches per step (no_sync / requires_gradient_sync),
and rank 0 writes the full final parameters, the BatchNorm running statistics (with
``--batchnorm``) and, for compiled models, how many graphs dynamo compiled.

``--configs '[[args...], ...]'`` runs several configurations in one job
(``tests/helpers/configs.py``). A compiled model's configuration starts from dynamo's state
of a fresh process (``torch._dynamo.reset()``, the graph counters cleared); inductor's
compiled code stays cached, so the configurations after the first reuse what it compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from tests.helpers.configs import worker_main
from tests.trainer_hook._exact_worker import IndexedData, make_optimizer, parse_plan
from trainer_hook import RebalanceHook

GLOBAL_BATCH = 12


def build_model(batchnorm: bool) -> torch.nn.Module:
    torch.manual_seed(7)
    layers: list[torch.nn.Module] = [torch.nn.Linear(5, 8)]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(8))
    layers += [torch.nn.Tanh(), torch.nn.Linear(8, 1)]
    return torch.nn.Sequential(*layers).to(torch.float64)


def _sleep(grad: torch.Tensor) -> torch.Tensor:
    time.sleep(0.03)
    return grad


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: it runs before the gradient reaches the model's output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _sleep(grad)


def wrap(model: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "ddp":
        # Each rank keeps its own batch-norm statistics (what the BatchNorm test checks).
        return DDP(model, broadcast_buffers=False)
    if how == "compiled-ddp":
        return DDP(torch.compile(model))
    if how in ("ddp-compiled", "ddp-then-compiled"):
        # torch.compile(DDP(model)): compiled here, or after hook.attach (main()).
        return torch.compile(DDP(model)) if how == "ddp-compiled" else DDP(model)
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        return fully_shard(model)  # type: ignore[no-any-return]
    if how in ("fsdp1", "fsdp1-nested"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        # Nested: each Linear its own FSDP instance, resharded after forward, so backward
        # all-gathers it again.
        policy = ModuleWrapPolicy({torch.nn.Linear}) if how == "fsdp1-nested" else None
        return FSDP(model, device_id=torch.device("cpu"), use_orig_params=True, auto_wrap_policy=policy)
    raise ValueError(how)


def no_sync(model: Any, how: str, last: bool) -> Any:
    if last:
        if how == "fsdp2":
            model.set_requires_gradient_sync(True)
        return nullcontext()
    if how == "fsdp2":
        model.set_requires_gradient_sync(False)
        return nullcontext()
    return model.no_sync()


def full_params(model: Any, how: str) -> list[list[Any]]:
    if how.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            return [p.detach().clone().tolist() for p in model.parameters()]
    out = []
    for p in model.parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(t.detach().tolist())
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--wrap", help="ddp, compiled-ddp, ddp-compiled, ddp-then-compiled, fsdp2, fsdp1, fsdp1-nested")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--plan", default="")
    p.add_argument("--batchnorm", action="store_true")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--gradients", default="auto", help="hook.attach(model, gradients=...)")
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps 30 ms in each step")
    p.add_argument("--slow-in", choices=("forward", "backward", "mid-backward"), default="forward",
                   help="where the slow rank sleeps: before the forward, as backward starts (before FSDP's "
                   "pre-backward unshard of the last layer), or after that unshard")
    p.add_argument("--mark-dynamic", action="store_true", help="mark the batch dimension dynamic up front")
    return p


def main() -> None:
    p = parser()
    args, _ = p.parse_known_args()
    if "--configs" not in sys.argv and not args.wrap:
        p.error("--wrap or --configs is required")
    worker_main(p, train)


def train(args: argparse.Namespace, out_dir: str) -> None:
    rank = dist.get_rank()
    if "compiled" in args.wrap:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()  # as a fresh process: the graph counts below are this configuration's
        counters.clear()
    hook = RebalanceHook(job="sharded", global_batch_size=GLOBAL_BATCH, exchange_every=2, exchange_lag=1)
    model = wrap(build_model(args.batchnorm), args.wrap)
    hook.attach(model, gradients=args.gradients)
    if args.wrap == "ddp-then-compiled":
        model = torch.compile(model)
    opt = make_optimizer(model)
    ds = IndexedData()
    loader: DataLoader[Any] = hook.data_loader(ds, shuffle=True, seed=3, num_workers=args.num_workers)
    plan = parse_plan(args.plan)
    bn = next((m for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d)), None)
    norm_steps: list[dict[str, Any]] = []
    while hook.batch_index < args.steps:
        for x, y, _idx in loader:
            k = hook.batch_index
            if rank == 0 and k in plan:
                hook.request_placement(plan[k], reason=f"plan@{k}")
            before = bn.running_mean.clone() if bn is not None else None
            with hook.step():
                # The same number of micro-batches on every rank (FSDP all-gathers in each
                # forward), some possibly empty when a rank's share is small.
                pieces = list(zip(x.tensor_split(args.accum), y.tensor_split(args.accum), strict=True))
                for i, (xi, yi) in enumerate(pieces):
                    if args.mark_dynamic and len(xi) > 1:
                        torch._dynamo.mark_dynamic(xi, 0)
                    slow = rank == args.slow_rank
                    if slow and args.slow_in == "forward":
                        time.sleep(0.03)  # before backward: compute, which the other rank waits for
                    with no_sync(model, args.wrap, last=i == len(pieces) - 1):
                        # The mean over this rank's whole local batch, spread over micro-batches.
                        out = model(xi)
                        if slow and args.slow_in == "backward":
                            out = _SleepInBackward.apply(out)
                        elif slow and args.slow_in == "mid-backward":
                            out.register_hook(_sleep)  # after the hooks FSDP put on the output
                        loss = torch.nn.functional.mse_loss(out, yi, reduction="sum") / len(x)
                        (loss * hook.loss_weight()).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if bn is not None and before is not None:
                norm_steps.append({"dummy": hook.shares[rank] == 0, "training": bn.training,
                                   "changed": not torch.equal(before, bn.running_mean)})
            if hook.batch_index >= args.steps:
                break
    hook.close()
    out: dict[str, Any] = {"rank": rank, "gradients": hook.gradients, "lookahead": hook.lookahead,
                           "acks": hook.acks, "shares": [list(t.shares) for t in hook.schedule.timeline()],
                           "compute_ms": [r.compute_ms for r in hook.history],
                           "sync_wait_ms": [r.sync_wait_ms for r in hook.history],
                           "comm_bytes": [r.comm_bytes for r in hook.history],
                           "comm_ms": [r.comm_ms for r in hook.history]}
    params = full_params(model, args.wrap)
    if bn is not None:
        out["bn"] = {"steps": norm_steps, "tracked": int(bn.num_batches_tracked)}
    if "compiled" in args.wrap:
        from torch._dynamo.utils import counters

        out["graphs"] = int(counters["stats"]["unique_graphs"])
    if rank == 0:
        out["params"] = params
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()

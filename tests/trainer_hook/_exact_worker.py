"""torchrun target for the exactness and lockstep tests (float64, tiny MLP, gloo).

Each rank trains ``--steps`` global batches with RebalanceHook, records which dataset
indices it trained for every batch index, and writes ``OUT/rank{r}.json``; rank 0 also
writes the final parameters. Placements are requested on rank 0 at the steps given by
``--plan STEP=S0,S1,S2;...`` (through ``request_placement``) or delivered as backend
``placement`` messages at a different step on each rank (``--deliver``), so that ranks
learn of a placement at different moments.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from rebalancer_wire.protocol import Placement
from tests.helpers.configs import worker_main
from tests.helpers.workers import parse_plan
from trainer_hook import RebalanceHook, _native_comm_hook

N_SAMPLES = 100
GLOBAL_BATCH = 12
LR = 0.05


class IndexedData(Dataset):  # type: ignore[type-arg]
    """Deterministic float64 samples that also return their own index."""

    def __init__(self, n: int = N_SAMPLES) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 5, generator=gen, dtype=torch.float64)
        self.y = torch.randn(n, 1, generator=gen, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def build_model() -> torch.nn.Sequential:
    torch.manual_seed(7)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ).to(torch.float64)


AUX_COEF = 0.5
L2_COEF = 0.01


class SideChannel(torch.nn.Module):
    """``build_model()``'s layers, keeping an activation-dependent loss term on the module
    instead of returning it (the habit of many mixture-of-experts layers)."""

    def __init__(self, net: torch.nn.Sequential) -> None:
        super().__init__()
        self.net = net
        self.aux = torch.zeros((), dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[1](self.net[0](x))
        self.aux = h.pow(2).mean()
        return self.net[2](h)  # type: ignore[no-any-return]


def loss_of(model: torch.nn.Module, inner: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The local mean loss; with a SideChannel model plus its stashed term and an L2 term
    on the parameters, both of which reach the parameters without passing through the
    model's output."""
    loss = torch.nn.functional.mse_loss(model(x), y)
    if isinstance(inner, SideChannel):
        loss = loss + AUX_COEF * inner.aux + L2_COEF * sum(p.pow(2).sum() for p in inner.parameters())
    return loss


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--plan", default="")
    p.add_argument("--deliver", default="", help="STEP0,STEP1,..:S0,S1,S2 per-rank delivery steps")
    p.add_argument("--invalid", action="store_true", help="rank 0 also receives invalid placements")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--lookahead", default="6", help="an int, or 'default' for HookConfig's own")
    p.add_argument("--loader", choices=("plain", "hook"), default="plain",
                   help="plain: DataLoader(batch_sampler=hook.batch_sampler(ds)); hook: hook.data_loader(ds)")
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--ckpt", default="", help="checkpoint file to write at --save-at, or to --resume from")
    p.add_argument("--save-at", type=int, default=-1, help="checkpoint after this many steps, then die 2 steps later")
    p.add_argument("--save-s", type=float, default=0.0,
                   help="seconds the checkpoint write takes (a sleep): what was reported before it has left")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--side-channel", action="store_true",
                   help="SideChannel model: loss terms that bypass the model's output")
    p.add_argument("--python-comm-hook", action="store_true",
                   help="DDP's Python comm hook, not the C++ one (REBALANCER_NATIVE_COMM_HOOK=0 while it attaches)")
    return p


def main() -> None:
    worker_main(parser(), train)


def train(args: argparse.Namespace, out_dir: str) -> None:
    """One configuration (``tests/helpers/configs.py``): results in ``out_dir``/rankN.json."""
    rank = dist.get_rank()
    extra = {} if args.lookahead == "default" else {"lookahead": int(args.lookahead)}
    hook = RebalanceHook(job="exact", global_batch_size=GLOBAL_BATCH, exchange_every=3, exchange_lag=1, **extra)
    inner = SideChannel(build_model()) if args.side_channel else build_model()
    model = DDP(inner)
    # The hook reads the switch as it attaches: this configuration alone, in a shared job.
    with mock.patch.dict(os.environ, {_native_comm_hook.ENV_VAR: "0"} if args.python_comm_hook else {}):
        hook.attach(model)
    opt = make_optimizer(model)
    ds = IndexedData()
    persistent = {"persistent_workers": True} if args.persistent else {}
    if args.loader == "hook":
        loader = hook.data_loader(ds, shuffle=True, seed=3, num_workers=args.num_workers, **persistent)
        sampler = loader.batch_sampler
    else:
        sampler = hook.batch_sampler(ds, shuffle=True, seed=3)
        loader = DataLoader(ds, batch_sampler=sampler, num_workers=args.num_workers, **persistent)
    if args.resume:
        ckpt = torch.load(args.ckpt, weights_only=True)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        hook.load_state_dict(ckpt["rebalancer"])
    plan = parse_plan(args.plan)
    deliver_at: int | None = None
    deliver_shares: list[int] = []
    if args.deliver:
        steps, shares = args.deliver.split(":")
        deliver_at = [int(s) for s in steps.split(",")][rank]
        deliver_shares = [int(s) for s in shares.split(",")]
    seen: list[dict[str, object]] = []
    errors: list[str] = []
    epoch = 0
    while hook.batch_index < args.steps:
        # The DDP tutorial's habit: both must be accepted (the epoch follows the batch index).
        if args.loader == "hook":
            loader.sampler.set_epoch(epoch)
        sampler.set_epoch(epoch)
        epoch += 1
        for x, y, idx in loader:
            k = hook.batch_index
            if rank == 0 and k in plan:
                hook.request_placement(plan[k], reason=f"plan@{k}")
            if deliver_at == k:
                # Every rank "receives" it; only rank 0 acts on it (it decides for all).
                hook._on_message(Placement(job="exact", version=50, shares=deliver_shares, global_batch_size=GLOBAL_BATCH))
            if rank == 0 and args.invalid and k == 4:
                for bad in ([6, 6], [4, 4, 5], [13, -1, 0], [4, 4, 4.0]):
                    hook._on_message(Placement(job="exact", version=90, shares=bad, global_batch_size=GLOBAL_BATCH))  # type: ignore[arg-type]
                hook._on_message(Placement(job="exact", version=0, shares=[2, 2, 8], global_batch_size=GLOBAL_BATCH))
                hook._on_message(Placement(job="exact", version=91, shares=[4, 4, 4], global_batch_size=24))
                try:
                    hook.request_placement([1, 2, 3])
                except ValueError as exc:
                    errors.append(str(exc))
            with hook.step() as k2:
                assert k2 == k
                if rank == args.slow_rank:
                    time.sleep(0.03)
                loss = loss_of(model, inner, x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            lo, hi = sampler.local_bounds(k)
            seen.append({
                "k": k, "indices": idx.tolist(), "dummy": hi == lo, "version": hook.placement_version,
                "shares": hook.shares,
            })
            if hook.batch_index == args.save_at:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "rebalancer": hook.state_dict()}, args.ckpt)
                dist.barrier()
                time.sleep(args.save_s)
            if args.save_at >= 0 and hook.batch_index == args.save_at + 2:
                # Killed between checkpoints: what it trained after the checkpoint is lost.
                with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                    json.dump({"seen": seen}, f)
                dist.barrier()
                os._exit(0)
            if hook.batch_index >= args.steps:
                break
    hook.close()
    out = {
        "rank": rank, "seen": seen, "acks": hook.acks, "rejections": hook.rejections,
        "request_errors": errors,
        "timeline": [[t.start_batch, t.version, list(t.shares)] for t in hook.schedule.timeline()],
        "lookahead": hook.lookahead,
        "gradients": hook.gradients, "native": hook._grads.native,
        "compute_ms": [r.compute_ms for r in hook.history],
        "step_ms": [r.step_ms for r in hook.history],
    }
    if rank == 0:
        out["params"] = [p.detach().tolist() for p in model.module.parameters()]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()

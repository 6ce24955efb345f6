"""torchrun target for the cost-partition exactness test (issue 23; float64, gloo).

Like ``_exact_worker`` but the sampler gets a per-sample cost (``cost_of``), so each
rank's samples of batch k come from the LPT partition and its count varies per batch.
Placements are requested on rank 0 at the steps of ``--plan``; with ``--save-at`` rank 0
checkpoints after that many steps and every rank stops; ``--resume`` goes on from it.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from tests.helpers.workers import write_rank_and_exit_group
from tests.trainer_hook import _exact_worker as w
from trainer_hook import RebalanceHook


def cost_of(i: int) -> float:
    """A heavy-tailed, deterministic 'token count' per dataset index."""
    return float(8 + (i * 37) % 23 + (400 if i % 11 == 0 else 0))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--plan", default="")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--callable", action="store_true", help="cost as a callable, not a list")
    p.add_argument("--ckpt", default="")
    p.add_argument("--save-at", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    # The lookahead is measured (the default), also when the resume with workers comes off
    # the exchange grid (batch 11, exchanges every 3).
    hook = RebalanceHook(job="cost", global_batch_size=w.GLOBAL_BATCH, exchange_every=3, exchange_lag=1)
    model = DDP(w.build_model())
    hook.attach(model)
    opt = w.make_optimizer(model)
    ds = w.IndexedData()
    cost = cost_of if args.callable else [cost_of(i) for i in range(len(ds))]
    if args.num_workers:  # hook.data_loader knows how far its workers prefetch
        loader = hook.data_loader(ds, shuffle=True, seed=3, sample_cost=cost, num_workers=args.num_workers)
        sampler = loader.batch_sampler
    else:
        sampler = hook.batch_sampler(ds, shuffle=True, seed=3, sample_cost=cost)
        loader = DataLoader(ds, batch_sampler=sampler)
    if args.resume:
        ckpt = torch.load(args.ckpt, weights_only=True)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        hook.load_state_dict(ckpt["rebalancer"])
    plan = w.parse_plan(args.plan)
    seen: list[dict[str, object]] = []
    stop = args.save_at if args.save_at >= 0 else args.steps
    while hook.batch_index < stop:
        for x, y, idx in loader:
            k = hook.batch_index
            if rank == 0 and k in plan:
                hook.request_placement(plan[k], reason=f"plan@{k}")
            with hook.step():
                loss = w.loss_of(model, model.module, x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            seen.append({"k": k, "indices": idx.tolist(), "dummy": sampler.local_size(k) == 0,
                         "work": sampler.local_work(k), "shares": hook.shares})
            if hook.batch_index >= stop:
                break
    if args.save_at >= 0 and rank == 0:
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "rebalancer": hook.state_dict()}, args.ckpt)
    hook.close()
    out: dict[str, object] = {"rank": rank, "seen": seen,
                              "timeline": [[t.start_batch, t.version, list(t.shares)] for t in hook.schedule.timeline()]}
    if rank == 0:
        out["params"] = [q.detach().tolist() for q in model.module.parameters()]
    write_rank_and_exit_group(args.out, out)


if __name__ == "__main__":
    main()

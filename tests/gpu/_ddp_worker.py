"""torchrun target of tests/gpu/test_ddp.py: the exactness worker's model and data
(tests/trainer_hook/_exact_worker.py) trained on ``cuda:LOCAL_RANK`` or, with
``--share-gpu``, every rank on ``cuda:0``, over ``--backend`` (nccl or gloo with CUDA
tensors). In the rehearsal (no CUDA): CPU tensors over gloo, with host stand-ins for the
timing events (tests/gpu/_rig.py). ``--slow-rank R --slow-ms M`` keeps rank R's device
busy M ms more in every forward. Writes ``OUT/rank{r}.json``; rank 0 the parameters too.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from tests.gpu._rig import Rig
from tests.trainer_hook import _exact_worker as w
from trainer_hook import RebalanceHook


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    p.add_argument("--share-gpu", action="store_true", help="every rank on cuda:0")
    p.add_argument("--plan", default="")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=0.0)
    args = p.parse_args()

    rig = Rig.detect()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if rig.is_cuda:
        device = torch.device("cuda", 0 if args.share_gpu else local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        rig.use_host_events()
    backend = args.backend if rig.is_cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    hook = RebalanceHook(job="gpu-exact", global_batch_size=w.GLOBAL_BATCH, exchange_every=3, exchange_lag=1,
                         lookahead=6)
    model = DDP(w.build_model().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    hook.attach(model)
    opt = w.make_optimizer(model)
    ds = w.IndexedData()
    sampler = hook.batch_sampler(ds, shuffle=True, seed=3)
    loader = DataLoader(ds, batch_sampler=sampler)
    plan = w.parse_plan(args.plan)
    epoch = 0
    while hook.batch_index < args.steps:
        sampler.set_epoch(epoch)
        epoch += 1
        for x, y, _ in loader:
            k = hook.batch_index
            if rank == 0 and k in plan:
                hook.request_placement(plan[k], reason=f"plan@{k}")
            x, y = x.to(device), y.to(device)
            with hook.step():
                if rank == args.slow_rank:
                    rig.busy(args.slow_ms)
                w.loss_of(model, model, x, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if hook.batch_index >= args.steps:
                break
    hook.close()
    events = hook._grads.events
    out = {
        "rank": rank, "backend": backend, "device": str(device), "gradients": hook.gradients,
        "events": getattr(events, "__qualname__", None) if events is not None else None,
        "timeline": [[t.start_batch, t.version, list(t.shares)] for t in hook.schedule.timeline()],
        "compute_ms": [r.compute_ms for r in hook.history],
        "sync_wait_ms": [r.sync_wait_ms for r in hook.history],
        "step_ms": [r.step_ms for r in hook.history],
    }
    if rank == 0:
        out["params"] = [p.detach().cpu().tolist() for p in model.module.parameters()]
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

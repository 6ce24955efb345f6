"""torchrun target for the communication tests: a DDP MLP whose slow ranks sleep per sample.

Each rank trains ``--steps`` global batches with RebalanceHook (offline, or streaming to
``--server``) and writes ``OUT/rank{r}.json``: its step records as sent and the bytes of
its parameters. Ranks in ``--slow`` sleep ``--delay-ms`` per sample in forward (the
device's compute), so the others wait for them inside the all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from trainer_hook import RebalanceHook

GLOBAL_BATCH = 16


class _Ballast(torch.autograd.Function):
    """0 in forward; in backward, the ballast's gradient is a zero tensor made once: no pass
    over its bytes and no fresh allocation a step (a large one is a fresh mmap and its page
    faults), so the ballast adds all-reduce bytes and next to no host work, as a GPU's
    gradient kernels would."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, zero_grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.zero_grad = zero_grad
        return param.new_zeros(())

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return ctx.zero_grad, None


class Sleepy(torch.nn.Module):
    """An MLP whose forward sleeps ``delay_s`` per sample (the device's compute), plus an
    optional ballast parameter of ``ballast`` floats: it adds all-reduce bytes without compute
    (a communication-bound job): ``_Ballast`` gives it a zero gradient that costs nothing
    for its size."""

    def __init__(self, width: int, delay_s: float, ballast: int = 0) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        self.ballast = torch.nn.Parameter(torch.zeros(ballast)) if ballast else None
        self._ballast_grad = torch.zeros(ballast) if ballast else None
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s * len(x))
        out = self.net(x)
        if self.ballast is not None:
            out = out + _Ballast.apply(self.ballast, self._ballast_grad)
        return out  # type: ignore[no-any-return]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--slow", default="", help="comma-separated ranks that sleep --delay-ms per sample")
    p.add_argument("--bucket-mb", type=float, default=0.1)
    p.add_argument("--server", default=None)
    p.add_argument("--job", default="comm")
    p.add_argument("--base-ms", type=float, default=0.0, help="per-sample sleep of every rank (slow ranks add --delay-ms)")
    p.add_argument("--shares", default="", help="a placement rank 0 requests at the first step")
    p.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    p.add_argument("--ballast-mb", type=float, default=0.0, help="MB of extra float32 parameters (all-reduce bytes, no compute)")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    slow = {int(r) for r in args.slow.split(",") if r}
    torch.manual_seed(0)
    model = Sleepy(args.width, (args.base_ms + (args.delay_ms if rank in slow else 0.0)) / 1e3,
                   ballast=int(args.ballast_mb * 2**20 / 4))
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
    # No placement exchange inside the measured steps and a fixed lookahead (no agreement at the
    # first step): the hook's own collectives are sync wait too (invariant 11), and this job
    # compares sync wait with the time inside the gradients' all-reduce alone.
    hook = RebalanceHook(server=args.server, job=args.job, global_batch_size=args.global_batch,
                         total_steps=args.steps, exchange_every=10_000, lookahead=1)
    hook.attach(ddp)
    gen = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(args.global_batch * args.steps, 8, generator=gen),
                       torch.randn(args.global_batch * args.steps, 1, generator=gen))
    # The ballast's gradient is always zero, so SGD's update of it changes nothing: left out,
    # it costs no CPU pass over its bytes (on a GPU a few microseconds; here CPU time the
    # ranks share on two cores). Its gradient is still all-reduced: DDP owns every parameter.
    opt = torch.optim.SGD([q for n, q in ddp.named_parameters() if not n.endswith("ballast")], lr=0.01)
    loader = hook.data_loader(ds, shuffle=False)
    for x, y in loader:
        if hook.batch_index >= args.steps:
            break
        if args.shares and rank == 0 and hook.batch_index == 0:
            hook.request_placement([int(v) for v in args.shares.split(",")])
        with hook.step():
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            # Zeroed in place: the gradients stay views of DDP's buckets, nothing is allocated.
            ddp.zero_grad(set_to_none=False)
    records = [r.to_dict() for r in hook.history]
    hook.close()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"records": records, "param_bytes": param_bytes, "native": hook._grads.native}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

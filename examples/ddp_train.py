"""The README's training loop as a runnable native-DDP job.

    rebalancer serve &                      # the backend (optional: without it, offline)
    torchrun --nproc-per-node 2 examples/ddp_train.py --server http://127.0.0.1:8000 --job demo

A tiny regression model on synthetic data, so it runs on any CPU. The hook gives each
rank its slice of every global batch, weights gradients by that slice, applies the
backend's placements in lockstep and streams step times to the dashboard. Leave out
``--server`` (and REBALANCER_SERVER) to train offline with the same code.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer_hook import RebalanceHook

import toy  # beside this file: the toy model and data, the command line


def main() -> None:
    p = toy.args(__doc__.split("\n\n")[0], job="ddp-example", global_batch_size=256, request=False)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (any number works)")
    args = p.parse_args()

    # torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR: NCCL and one GPU per rank where
    # there are GPUs, gloo on CPU.
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    ds = toy.data(4096)
    model = toy.model().to(device)
    loss_fn = torch.nn.MSELoss()  # a mean over the local batch: the hook weights it by share
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    hook = RebalanceHook(server=args.server, job=args.job, global_batch_size=args.global_batch_size)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    hook.attach(model)
    loader = hook.data_loader(ds, shuffle=True, seed=0, num_workers=args.num_workers,
                              pin_memory=device.type == "cuda")
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)  # as with DistributedSampler; the order follows the batch index
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with hook.step():
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
        if hook.rank == 0:
            last = hook.last_step
            # loss.item(): a sync point, once per epoch
            print(toy.epoch_line(epoch, hook, loss=f"{loss.item():.4f}",
                                 compute=f"{last.compute_ms if last else 0:.2f} ms"), flush=True)
    hook.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

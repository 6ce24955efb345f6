"""Rebalanced training with Hugging Face Accelerate.

    rebalancer serve &                      # the backend (optional: without it, offline)
    torchrun --nproc-per-node 2 examples/accelerate_train.py --server http://127.0.0.1:8000
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py   # on GPUs

(On CPU, ``accelerate launch --cpu`` starts a single process unless MPI is set up; use torchrun.)

A tiny regression model on synthetic data, so it runs on any CPU. ``prepare_with_rebalancer``
lets Accelerate wrap the model in DDP and place batches on the device, while the hook
decides each rank's slice of every global batch and weights its gradients.
``--grad-accum N`` accumulates N global batches per optimizer step (the hook then
weights each micro-batch's loss instead of the all-reduce).
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator
from torch.utils.data import TensorDataset

from trainer_hook import RebalanceHook
from trainer_hook.integrations.accelerate import prepare_with_rebalancer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default=None, help="backend URL (default: REBALANCER_SERVER, else offline)")
    p.add_argument("--job", default="accelerate-example")
    p.add_argument("--global-batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--request", default=None, metavar="STEP:S0,S1,...",
                   help="rank 0 asks for this split at STEP (try it offline, e.g. 3:96,32)")
    args = p.parse_args()

    # cpu=True when there is no GPU: otherwise Accelerate treats each process as alone.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.grad_accum)
    torch.manual_seed(0)
    x = torch.randn(2048, 16)
    ds = TensorDataset(x, x @ torch.randn(16, 1) + 0.1 * torch.randn(2048, 1))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = torch.nn.MSELoss()  # a mean over this rank's samples

    hook = RebalanceHook(server=args.server, job=args.job, global_batch_size=args.global_batch_size)
    model, optimizer, loader = prepare_with_rebalancer(accelerator, hook, model, optimizer, ds, shuffle=True, seed=0)
    request = None
    if args.request:
        step, shares = args.request.split(":")
        request = (int(step), [int(s) for s in shares.split(",")])

    for epoch in range(args.epochs):
        for x, y in loader:
            with hook.step() as k, accelerator.accumulate(model):
                if request and hook.rank == 0 and k == request[0]:
                    hook.request_placement(request[1], reason="example --request")
                loss = loss_fn(model(x), y)
                # loss_weight() is 1.0 with the comm hook, the rank's weight with accumulation.
                accelerator.backward(loss * hook.loss_weight())
                optimizer.step()
                optimizer.zero_grad()
        if accelerator.is_main_process:
            print(f"epoch {epoch}: batch {hook.batch_index}, loss {loss.item():.4f}, "  # a sync point, once per epoch
                  f"placement v{hook.placement_version} {hook.shares}", flush=True)
    hook.close()
    accelerator.end_training()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

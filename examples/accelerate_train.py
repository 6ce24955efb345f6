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

import os

import torch
from accelerate import Accelerator

from trainer_hook import RebalanceHook
from trainer_hook.integrations.accelerate import prepare_with_rebalancer

import toy  # beside this file: the toy model and data, the command line


def main() -> None:
    p = toy.args(__doc__.split("\n\n")[0], job="accelerate-example", global_batch_size=128)
    p.add_argument("--grad-accum", type=int, default=1)
    args = p.parse_args()

    # cpu=True when there is no GPU: otherwise Accelerate treats each process as alone.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.grad_accum)
    torch.manual_seed(0)
    ds = toy.data(2048)
    model = toy.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = torch.nn.MSELoss()  # a mean over this rank's samples

    hook = RebalanceHook(server=args.server, job=args.job, global_batch_size=args.global_batch_size)
    model, optimizer, loader = prepare_with_rebalancer(accelerator, hook, model, optimizer, ds, shuffle=True, seed=0)
    at, shares = toy.requested_split(args.request)
    for epoch in range(args.epochs):
        for x, y in loader:
            with hook.step() as k, accelerator.accumulate(model):
                if hook.rank == 0 and k == at:
                    hook.request_placement(shares, reason="example --request")
                loss = loss_fn(model(x), y)
                # loss_weight() is 1.0 with the comm hook, the rank's weight with accumulation.
                accelerator.backward(loss * hook.loss_weight())
                optimizer.step()
                optimizer.zero_grad()
        if accelerator.is_main_process:
            print(toy.epoch_line(epoch, hook, loss=f"{loss.item():.4f}"), flush=True)  # .item(): a sync point, once per epoch
    hook.close()
    accelerator.end_training()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

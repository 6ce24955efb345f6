"""Rebalanced training launched the notebook way, with ``accelerate.notebook_launcher``.

    python examples/notebook_launch.py --num-processes 2 [--server http://127.0.0.1:8000]

Paste ``train`` and the ``notebook_launch(...)`` call into a Jupyter cell to run it from
a notebook: the launcher forks one process per device from the kernel. Create the
Accelerator and the RebalanceHook inside the training function, never in the kernel.
"""

from __future__ import annotations

import argparse
import os

from trainer_hook.integrations.notebook import notebook_launch


def train(global_batch_size: int, epochs: int, request: str | None) -> None:
    import torch
    from accelerate import Accelerator
    from torch.utils.data import TensorDataset

    from trainer_hook import RebalanceHook
    from trainer_hook.integrations.accelerate import prepare_with_rebalancer

    accelerator = Accelerator()  # notebook_launch sets CPU mode when there is no GPU
    torch.manual_seed(0)
    x = torch.randn(2048, 16)
    ds = TensorDataset(x, x @ torch.randn(16, 1) + 0.1 * torch.randn(2048, 1))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    hook = RebalanceHook(global_batch_size=global_batch_size)  # server/job from notebook_launch
    model, optimizer, loader = prepare_with_rebalancer(accelerator, hook, model, optimizer, ds)
    at, shares = (int(request.split(":")[0]), [int(s) for s in request.split(":")[1].split(",")]) if request else (-1, [])
    for epoch in range(epochs):
        for x, y in loader:
            with hook.step() as k:
                if hook.rank == 0 and k == at:
                    hook.request_placement(shares, reason="notebook example")
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss * hook.loss_weight())
                optimizer.step()
                optimizer.zero_grad()
        if accelerator.is_main_process:
            print(f"epoch {epoch}: batch {hook.batch_index}, loss {loss.item():.4f}, "  # a sync point, once per epoch
                  f"world {accelerator.num_processes}, placement v{hook.placement_version} {hook.shares}", flush=True)
    hook.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--server", default=None)
    p.add_argument("--job", default="notebook-example")
    p.add_argument("--global-batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--request", default=None, metavar="STEP:S0,S1,...")
    args = p.parse_args()
    notebook_launch(train, args=(args.global_batch_size, args.epochs, args.request),
                    num_processes=args.num_processes, server=args.server, job=args.job if args.server else None)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""Rebalanced training with the Hugging Face Trainer.

    rebalancer serve &                      # the backend (optional: without it, offline)
    torchrun --nproc-per-node 2 examples/hf_trainer_train.py --server http://127.0.0.1:8000

A tiny model built here (no download from a hub) on synthetic data, so it runs on any
CPU. ``RebalancingTrainer`` is a ``Trainer`` whose training loader uses the hook's batch
sampler and whose DDP model carries the hook's gradient weighting; everything else
(arguments, callbacks, logging, evaluation) is the ordinary Trainer.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from transformers import TrainerCallback, TrainingArguments

from trainer_hook import RebalanceHook
from trainer_hook.integrations.hf_trainer import RebalancingTrainer

import toy  # beside this file: the command line the examples share


class Regressor(nn.Module):
    """Takes the batch's fields as keyword arguments and returns its loss, like HF models."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        pred = self.net(x).squeeze(-1)
        return {"loss": nn.functional.mse_loss(pred, labels), "logits": pred}


class Points(torch.utils.data.Dataset):
    def __init__(self, n: int = 2048) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x @ torch.randn(16, 1, generator=g)).squeeze(-1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class RequestAt(TrainerCallback):
    """Rank 0 asks for a split at one optimizer step (to watch a placement change offline)."""

    def __init__(self, hook: RebalanceHook, step: int, shares: list[int]) -> None:
        self.hook, self.step, self.shares = hook, step, shares

    def on_step_begin(self, args, state, control, **kwargs):
        if self.hook.rank == 0 and state.global_step == self.step:
            self.hook.request_placement(self.shares, reason="example --request")


class PrintPlacement(TrainerCallback):
    def __init__(self, hook: RebalanceHook) -> None:
        self.hook = hook

    def on_epoch_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(toy.epoch_line(f"{state.epoch:.0f}", self.hook, step=state.global_step), flush=True)


def main() -> None:
    p = toy.args(__doc__.split("\n\n")[0], job="hf-trainer-example", global_batch_size=128, epochs=float)
    p.add_argument("--output-dir", default="/tmp/rebalancer-hf-example")
    args = p.parse_args()

    # Under torchrun the Trainer would create the process group itself; the hook needs it first.
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    hook = RebalanceHook(server=args.server, job=args.job, global_batch_size=args.global_batch_size)
    callbacks: list[TrainerCallback] = [PrintPlacement(hook)]
    if args.request:
        callbacks.append(RequestAt(hook, *toy.requested_split(args.request)))
    torch.manual_seed(0)
    trainer = RebalancingTrainer(
        rebalance_hook=hook,
        model=Regressor(),
        train_dataset=Points(),
        callbacks=callbacks,
        args=TrainingArguments(
            output_dir=args.output_dir, num_train_epochs=args.epochs, learning_rate=0.05,
            use_cpu=not torch.cuda.is_available(), report_to=[], save_strategy="no",
            logging_strategy="no", disable_tqdm=True, dataloader_pin_memory=False,
            ddp_find_unused_parameters=False,
        ),
    )
    trainer.train()
    hook.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

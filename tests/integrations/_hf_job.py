"""torchrun target: transformers Trainer + RebalancingTrainer, placements change mid-run.

Usage: python -m tests.integrations._hf_job OUT_DIR MAX_STEPS [GRAD_ACCUM] [tokens|tokens_cost|samples] [save|resume]
   or: python -m tests.integrations._hf_job --configs OUT_DIR '[[MAX_STEPS, ...], ...]'

The hook is created before the TrainingArguments, which start the process group, and
measures its lookahead. ``save``: a checkpoint at the last step (next to OUT_DIR);
``resume``: ``trainer.train(resume_from_checkpoint=...)`` from it. ``--configs`` runs each
argument list after the other in one job (a job's start, every rank importing transformers,
costs more than a run), with the results of the N-th in OUT_DIR/cfgN and the checkpoint in
OUT_DIR/hf_ckpt: the first configuration's hook is created before the process group exists,
the others' after; Accelerate's process-wide state is reset between them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from tests.integrations._common import (
    GLOBAL_BATCH,
    N_SAMPLES,
    IndexedData,
    TinyNet,
    TokenData,
    TokenNet,
    accelerate_configs_main,
    dump,
    make_optimizer,
)
from trainer_hook import RebalanceHook
from trainer_hook.integrations.hf_trainer import RebalancingTrainer

# (request at optimizer step, shares) for 2 ranks; B = 12. The token run also drains rank 1.
REQUESTS = {1: [9, 3], 5: [2, 10]}
TOKEN_REQUESTS = {1: [9, 3], 5: [12, 0]}


class Recording:
    """Remembers which samples each hook step trained on this rank."""

    hook: Any = None

    def record(self, idx: torch.Tensor) -> None:
        if self.training:  # type: ignore[attr-defined]
            h = self.hook
            self.seen[h.batch_index] = {  # type: ignore[attr-defined]
                "idx": idx.tolist(), "version": h.placement_version, "dummy": h.shares[h.rank] == 0,
            }


class RecordingNet(Recording, TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, dict[str, Any]] = {}

    def forward(self, x, labels, idx=None):  # type: ignore[override]
        self.record(idx)
        return super().forward(x, labels)


class RecordingTokenNet(Recording, TokenNet):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, dict[str, Any]] = {}

    def forward(self, x, labels, idx=None, **kwargs):  # type: ignore[override]
        self.record(idx)
        return super().forward(x, labels, **kwargs)


class Requests(TrainerCallback):
    def __init__(self, hook: RebalanceHook, requests: dict[int, list[int]]) -> None:
        self.hook = hook
        self.requests = requests

    def on_step_begin(self, args, state, control, **kwargs):
        if self.hook.rank == 0 and state.global_step in self.requests:
            self.hook.request_placement(self.requests[state.global_step], reason="test")


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def run(out_dir: str, argv: Sequence[str]) -> None:
    max_steps = int(argv[0])
    accum = int(argv[1]) if len(argv) > 1 else 1
    tokens = len(argv) > 2 and argv[2] in ("tokens", "tokens_cost")
    # tokens_cost: each sample's valid-target count is its cost, so shares split tokens
    cost = [i % 3 + 1 for i in range(N_SAMPLES)] if len(argv) > 2 and argv[2] == "tokens_cost" else None
    ckpt = argv[3] if len(argv) > 3 else ""
    ckpt_root = os.path.join(os.path.dirname(os.path.abspath(out_dir)), "hf_ckpt")
    # Issue 10: created before TrainingArguments (no process group yet): it waits for it.
    hook = RebalanceHook(global_batch_size=GLOBAL_BATCH, exchange_every=2, exchange_lag=1)
    model = RecordingTokenNet() if tokens else RecordingNet()
    model.hook = hook
    optimizer = make_optimizer(model)
    constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    args = TrainingArguments(
        output_dir=ckpt_root if ckpt else f"{out_dir}/trainer", use_cpu=True, max_steps=max_steps,
        gradient_accumulation_steps=accum, max_grad_norm=0.0, report_to=[],
        save_strategy="steps" if ckpt == "save" else "no", save_steps=max_steps, save_only_model=False, logging_strategy="no", disable_tqdm=True,
        dataloader_pin_memory=False, ddp_find_unused_parameters=False, seed=3, data_seed=7,
    )
    trainer = RebalancingTrainer(
        rebalance_hook=hook, sample_cost=cost, model=model, args=args, train_dataset=TokenData() if tokens else IndexedData(), data_collator=collate,
        optimizers=(optimizer, constant), callbacks=[Requests(hook, TOKEN_REQUESTS if tokens else REQUESTS)],
    )
    if ckpt == "resume":
        trainer.train(resume_from_checkpoint=get_last_checkpoint(ckpt_root))
    else:
        trainer.train()
    payload = {
        "batches": model.seen, "acks": hook.acks, "mode": trainer.accelerator.distributed_type.value,
        "world": trainer.accelerator.num_processes, "gradients": trainer.rebalance_callback.gradients,
        "global_step": trainer.state.global_step, "loss_is_global": trainer._loss_is_global(),
        "total_steps": hook.total_steps, "hook_steps": hook.batch_index, "lookahead": hook.lookahead,
    }
    hook.close()
    dump(out_dir, hook.rank, payload, model)


if __name__ == "__main__":
    accelerate_configs_main(run, sys.argv[1:])

"""torchrun target: a LightningModule under Trainer(strategy="ddp") on CPU with the
rebalancer's callback; placements requested mid-run; records what every rank trained.

Usage: python -m tests.integrations._lightning_job OUT_DIR STEPS [CKPT_DIR [resume]]
       python -m tests.integrations._lightning_job OUT_DIR STEPS CKPT_DIR tokens TOKENS_OUT TOKENS_STEPS
       python -m tests.integrations._lightning_job OUT_DIR STEPS tokens

Without ``tokens`` the job fits twice in the one launch: under ``strategy="ddp"`` (into
OUT_DIR and CKPT_DIR), then under FSDP2, ``ModelParallelStrategy(data_parallel_size=2,
tensor_parallel_size=1)`` with ``fully_shard`` in ``configure_model`` (into OUT_DIR-fsdp2
and CKPT_DIR-fsdp2; there each checkpoint is a directory of shards). Without ``resume`` a
ModelCheckpoint saves every 8 steps into CKPT_DIR; with it the run resumes from
CKPT_DIR/step8.ckpt (Lightning's own checkpoint) and trains to STEPS. With
``tokens`` the module trains TokenNet on TokenData with the loss a mean over the global
batch's valid targets: the summed loss times ``callback.token_loss_weight(n_valid)``;
after CKPT_DIR, ``tokens TOKENS_OUT TOKENS_STEPS`` adds that fit (``strategy="ddp"``) to the
launch, between the other two (a launch's start, every rank importing Lightning, costs more
than a fit).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from tests.integrations._common import (
    GLOBAL_BATCH,
    IndexedData,
    TinyNet,
    TokenData,
    TokenNet,
    dump,
    make_optimizer,
)
from trainer_hook import RebalanceHook
from trainer_hook.integrations.lightning import RebalanceLightningCallback, pl

# (request at step, shares) for 2 ranks; B = 12. The third is agreed around the checkpoint.
REQUESTS = {1: [9, 3], 5: [2, 10], 7: [7, 5]}


class Module(pl.LightningModule):
    def __init__(self, rebalance: RebalanceLightningCallback, tokens: bool = False, fsdp2: bool = False) -> None:
        super().__init__()
        self.tokens = tokens
        self.fsdp2 = fsdp2
        self.net: Any = TokenNet() if tokens else TinyNet()
        self.rebalance = rebalance
        self.batches: dict[int, dict[str, Any]] = {}

    def configure_model(self) -> None:
        if self.fsdp2:  # per layer, then the root, over the strategy's data-parallel mesh
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def train_dataloader(self) -> Any:
        return self.rebalance.train_dataloader(TokenData() if self.tokens else IndexedData(), shuffle=True, seed=7)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        hook = self.rebalance.hook
        k = hook.batch_index
        if hook.rank == 0 and k in REQUESTS:
            hook.request_placement(REQUESTS[k], reason="test")
        self.batches[k] = {
            "idx": batch["idx"].tolist(), "version": hook.placement_version,
            "dummy": hook.shares[hook.rank] == 0,
        }
        if not self.tokens:
            return self.net(batch["x"], batch["labels"])["loss"]
        labels = batch["labels"]
        valid = labels != -100
        loss_sum = ((self.net.net(batch["x"]) - labels) ** 2 * valid).sum()
        return loss_sum * self.rebalance.token_loss_weight(valid.sum())

    def configure_optimizers(self) -> Any:
        return make_optimizer(self.net)


def fit(out_dir: str, steps: int, ckpt_dir: str | None, resume: bool, *, tokens: bool, fsdp2: bool) -> None:
    hook = RebalanceHook(global_batch_size=GLOBAL_BATCH, exchange_every=2, exchange_lag=1)
    rebalance = RebalanceLightningCallback(hook)
    callbacks: list[Any] = [rebalance]
    if ckpt_dir and not resume:
        callbacks.append(pl.callbacks.ModelCheckpoint(
            dirpath=ckpt_dir, filename="step{step}", auto_insert_metric_name=False,
            every_n_train_steps=8, save_top_k=-1))
    world = int(os.environ["WORLD_SIZE"])
    strategy: Any = "ddp"
    if fsdp2:
        strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(ckpt_dir and not resume), num_sanity_val_steps=0,
    )
    module = Module(rebalance, tokens=tokens, fsdp2=fsdp2)
    trainer.fit(module, ckpt_path=os.path.join(ckpt_dir, "step8.ckpt") if resume and ckpt_dir else None)
    payload = {"batches": module.batches, "acks": hook.acks, "world": trainer.world_size,
               "gradients": hook.gradients, "total_steps": hook.total_steps}
    hook.close()
    net: Any = module.net
    if fsdp2:  # the sharded parameters, gathered whole (a collective: every rank calls it)
        net = TinyNet()
        net.load_state_dict({k: v.full_tensor() for k, v in module.net.state_dict().items()})
    dump(out_dir, hook.rank, payload, net)


def main() -> None:
    out_dir, steps = sys.argv[1], int(sys.argv[2])
    tokens = len(sys.argv) > 3 and sys.argv[3] == "tokens"
    ckpt_dir = sys.argv[3] if len(sys.argv) > 3 and not tokens else None
    resume = len(sys.argv) > 4 and sys.argv[4] == "resume"
    fit(out_dir, steps, ckpt_dir, resume, tokens=tokens, fsdp2=False)
    if len(sys.argv) > 6 and sys.argv[4] == "tokens":
        fit(sys.argv[5], int(sys.argv[6]), None, False, tokens=True, fsdp2=False)
    if not tokens:
        fit(out_dir + "-fsdp2", steps, ckpt_dir and ckpt_dir + "-fsdp2", resume, tokens=False, fsdp2=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

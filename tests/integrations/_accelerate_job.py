"""torchrun target: Accelerate + RebalanceHook, placement changes mid-run, records all.

Usage: python -m tests.integrations._accelerate_job OUT_DIR STEPS [GRAD_ACCUM] [NUM_WORKERS] [save|resume]

With workers the hook is created before the Accelerator (which starts the process group)
and measures its lookahead. ``save``: ``accelerator.save_state`` after 10 steps, then die
2 steps later; ``resume``: ``accelerator.load_state`` first (the hook is registered for
checkpointing by prepare_with_rebalancer).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist
from accelerate import Accelerator

from tests.integrations._common import GLOBAL_BATCH, IndexedData, TinyNet, dump, make_optimizer
from trainer_hook import RebalanceHook
from trainer_hook.integrations.accelerate import prepare_with_rebalancer

# (request at step, shares) for 2 ranks; B = 12.
REQUESTS = {1: [9, 3], 5: [2, 10]}


def main() -> None:
    out_dir, steps = sys.argv[1], int(sys.argv[2])
    accum = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    workers = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    ckpt = sys.argv[5] if len(sys.argv) > 5 else ""
    if workers == 0:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
        hook = RebalanceHook(global_batch_size=GLOBAL_BATCH, exchange_every=2, exchange_lag=1, lookahead=2)
    else:  # issue 10: the hook first, before the process group exists; lookahead measured
        hook = RebalanceHook(global_batch_size=GLOBAL_BATCH, exchange_every=2, exchange_lag=1)
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    ckpt_dir = os.path.join(os.path.dirname(os.path.abspath(out_dir)), "acc_ckpt")
    data = IndexedData()
    model = TinyNet()
    optimizer = make_optimizer(model)
    model, optimizer, loader = prepare_with_rebalancer(
        accelerator, hook, model, optimizer, data, shuffle=True, seed=7, num_workers=workers
    )
    if ckpt == "resume":
        accelerator.load_state(ckpt_dir)
    batches: dict[int, dict] = {}
    trained = hook.batch_index
    while trained < steps:
        for batch in loader:
            with hook.step() as k, accelerator.accumulate(model):
                if hook.rank == 0 and k in REQUESTS:
                    hook.request_placement(REQUESTS[k], reason="test")
                out = model(batch["x"], batch["labels"])
                accelerator.backward(out["loss"] * hook.loss_weight())
                optimizer.step()
                optimizer.zero_grad()
                batches[k] = {
                    "idx": batch["idx"].tolist(), "version": hook.placement_version,
                    "dummy": hook.shares[hook.rank] == 0,
                }
            trained += 1
            if ckpt == "save" and trained == 10:
                accelerator.save_state(ckpt_dir)
            if ckpt == "save" and trained == 12:  # killed: the last two steps are lost
                dump(out_dir, hook.rank, {"batches": batches}, accelerator.unwrap_model(model))
                dist.barrier()
                os._exit(0)
            if trained >= steps:
                break
    payload = {
        "batches": batches, "acks": hook.acks, "mode": accelerator.distributed_type.value,
        "world": accelerator.num_processes, "lookahead": hook.lookahead,
    }
    hook.close()
    dump(out_dir, hook.rank, payload, accelerator.unwrap_model(model))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

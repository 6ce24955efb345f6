"""Run with plain ``python``: notebook_launch forks 2 CPU ranks that train with the hook.

Usage: python -m tests.integrations._notebook_job OUT_DIR STEPS
"""

from __future__ import annotations

import sys

from trainer_hook.integrations.notebook import notebook_launch

REQUESTS = {1: [9, 3]}


def train(out_dir: str, steps: int) -> None:
    # Everything framework-side is created here, in the forked process.
    from accelerate import Accelerator

    from tests.integrations._common import GLOBAL_BATCH, IndexedData, TinyNet, dump, make_optimizer
    from trainer_hook import RebalanceHook
    from trainer_hook.integrations.accelerate import prepare_with_rebalancer

    accelerator = Accelerator()
    hook = RebalanceHook(global_batch_size=GLOBAL_BATCH, exchange_every=2, exchange_lag=1, lookahead=2)
    model = TinyNet()
    model, optimizer, loader = prepare_with_rebalancer(
        accelerator, hook, model, make_optimizer(model), IndexedData(), seed=7
    )
    batches: dict[int, dict] = {}
    while len(batches) < steps:
        for batch in loader:
            with hook.step() as k:
                if hook.rank == 0 and k in REQUESTS:
                    hook.request_placement(REQUESTS[k], reason="notebook test")
                loss = model(batch["x"], batch["labels"])["loss"]
                accelerator.backward(loss * hook.loss_weight())
                optimizer.step()
                optimizer.zero_grad()
                batches[k] = {"idx": batch["idx"].tolist(), "version": hook.placement_version, "dummy": False}
            if len(batches) >= steps:
                break
    payload = {
        "batches": batches, "acks": hook.acks, "mode": accelerator.distributed_type.value,
        "world": accelerator.num_processes,
    }
    hook.close()
    dump(out_dir, hook.rank, payload, accelerator.unwrap_model(model))


if __name__ == "__main__":
    notebook_launch(train, args=(sys.argv[1], int(sys.argv[2])), num_processes=2)

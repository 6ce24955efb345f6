"""torchrun target: Accelerate + RebalanceHook, placement changes mid-run, records all.

Usage: python -m tests.integrations._accelerate_job OUT_DIR STEPS [GRAD_ACCUM] [NUM_WORKERS] [save|resume]
   or: python -m tests.integrations._accelerate_job --configs OUT_DIR '[[STEPS, ...] or ["mismatch"], ...]'

With workers the hook is created before the Accelerator (which starts the process group)
and measures its lookahead. ``save``: ``accelerator.save_state`` after 10 steps, then die
2 steps later; ``resume``: ``accelerator.load_state`` first (the hook is registered for
checkpointing by prepare_with_rebalancer). The checkpoint lies next to OUT_DIR.

``--configs`` runs each argument list after the other in one job (a job's start costs more
than a run), the N-th one's results in OUT_DIR/cfgN; Accelerate's process-wide state is
reset between them, and only the first one's hook can be created before the process group
exists. ``save`` ends the process, so it comes last. ``mismatch``: ``Accelerator()`` without
CPU mode on a machine without GPUs; each rank writes the adapter's error to ``rankN.txt``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist
from accelerate import Accelerator

from tests.integrations._common import (
    GLOBAL_BATCH,
    IndexedData,
    TinyNet,
    accelerate_configs_main,
    dump,
    make_optimizer,
)
from trainer_hook import RebalanceHook
from trainer_hook.integrations.accelerate import prepare_with_rebalancer

# (request at step, shares) for 2 ranks; B = 12.
REQUESTS = {1: [9, 3], 5: [2, 10]}


def run(out_dir: str, argv: Sequence[str]) -> None:
    steps = int(argv[0])
    accum = int(argv[1]) if len(argv) > 1 else 1
    workers = int(argv[2]) if len(argv) > 2 else 0
    ckpt = argv[3] if len(argv) > 3 else ""
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


def mismatch(out_dir: str) -> None:
    """Accelerator() without CPU mode on a machine without GPUs (the process group exists)."""
    hook = RebalanceHook(global_batch_size=GLOBAL_BATCH)
    accelerator = Accelerator()  # the mistake on a machine without GPUs: no cpu=True
    model = TinyNet()
    try:
        prepare_with_rebalancer(accelerator, hook, model, make_optimizer(model), IndexedData())
        line = f"rank {hook.rank}: NO ERROR"
    except ValueError as exc:
        line = f"rank {hook.rank}: {exc}"
    hook.close()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{hook.rank}.txt").write_text(line)


def run_or_mismatch(out_dir: str, argv: Sequence[str]) -> None:
    if list(argv) == ["mismatch"]:
        mismatch(out_dir)
    else:
        run(out_dir, argv)


if __name__ == "__main__":
    accelerate_configs_main(run_or_mismatch, sys.argv[1:])

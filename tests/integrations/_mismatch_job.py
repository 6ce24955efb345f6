"""torchrun target: Accelerator() without CPU mode on a machine without GPUs.

Prints the adapter's error (each process would otherwise train alone).
"""

from __future__ import annotations

import torch.distributed as dist
from accelerate import Accelerator

from tests.integrations._common import GLOBAL_BATCH, IndexedData, TinyNet, make_optimizer
from trainer_hook import RebalanceHook
from trainer_hook.integrations.accelerate import prepare_with_rebalancer


def main() -> None:
    dist.init_process_group("gloo")
    hook = RebalanceHook(global_batch_size=GLOBAL_BATCH)
    accelerator = Accelerator()  # the mistake on a machine without GPUs: no cpu=True
    model = TinyNet()
    try:
        prepare_with_rebalancer(accelerator, hook, model, make_optimizer(model), IndexedData())
        print(f"rank {hook.rank}: NO ERROR", flush=True)
    except ValueError as exc:
        print(f"rank {hook.rank}: {exc}", flush=True)
    hook.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""torchrun target (2 ranks): FSDP1 HYBRID_SHARD over a (1, 2) mesh; prints what attach() says.

One rank is not enough: FSDP1 turns any strategy into NO_SHARD with a world of one."""

from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from trainer_hook import RebalanceHook  # noqa: E402


def main() -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    model = FullyShardedDataParallel(torch.nn.Linear(4, 4), device_mesh=mesh, device_id=torch.device("cpu"),
                                     sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    hook = RebalanceHook(global_batch_size=4)
    try:
        hook.attach(model)
        said = f"rank {dist.get_rank()} ATTACHED {hook.gradients}"
    except ValueError as exc:
        said = f"rank {dist.get_rank()} REFUSED {exc}"
    # One write per line: print() writes the text and the newline apart, and the two ranks
    # share torchrun's stdout, so their lines could run into one another.
    os.write(1, (said + "\n").encode())
    hook.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""DP x TP with FSDP2, the torchtitan way, balanced over data-parallel replicas.

A 2-D device mesh ("dp", "tp"): each linear layer is split over "tp" (Colwise then Rowwise,
as torchtitan does for an MLP), the model is sharded over "dp" with ``fully_shard``, and the
hook gets ``dp_mesh=mesh["dp"]``: shares are per replica (per TP group), both ranks of one
TP group read the same samples. Runs on CPU:

    torchrun --nproc-per-node 4 examples/mesh_dp_tp.py            # offline, 2 replicas x 2
    torchrun --nproc-per-node 4 examples/mesh_dp_tp.py --hsdp     # HSDP 2 x 2 instead
    REBALANCER_SERVER=http://127.0.0.1:8000 torchrun --nproc-per-node 4 examples/mesh_dp_tp.py
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import TensorDataset

from trainer_hook import RebalanceHook


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hsdp", action="store_true", help="fully_shard on a (replicate, shard) mesh, no TP")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (DP x TP)")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    if args.hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        fully_shard(model, mesh=mesh)
        dp_mesh = mesh  # both dimensions are data parallel
    else:
        mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        dp_mesh = mesh["dp"]
    hook = RebalanceHook(job=os.environ.get("REBALANCER_JOB", "mesh-example"), global_batch_size=32,
                         dp_mesh=dp_mesh)
    hook.attach(model)  # FSDP2's reduce-scatter weights each replica by its share
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(2048, 16, generator=gen), torch.randn(2048, 1, generator=gen))
    loader = hook.data_loader(ds, shuffle=True, seed=0)
    while hook.batch_index < args.steps:
        for x, y in loader:
            with hook.step():
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            if hook.batch_index >= args.steps:
                break
    if dist.get_rank() == 0:
        print(f"replicas {hook.world_size}, shares per replica {hook.shares}, last loss {loss.item():.4f}")
    hook.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

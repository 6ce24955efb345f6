"""Device-mesh set-ups hook.attach() must refuse or accept, on 4 ranks: ``attach_all()``
builds every scenario in turn, calls ``hook.attach(model)`` and returns what happened
(``{"scenario": "ATTACHED <mechanism>" | "REFUSED <message>"}``). Run by the mesh job
(``_dp_mesh_worker.py``) before its training cases, so that one launch serves both."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainer_hook import RebalanceHook


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _dp2_tp2() -> torch.nn.Module:
    """torchtitan's layout: Colwise/Rowwise over "tp", then fully_shard over "dp"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_mlp(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return fully_shard(model, mesh=mesh["dp"])  # type: ignore[no-any-return]


def _fsdp2_dp_submesh() -> torch.nn.Module:
    """fully_shard over a 2-rank "dp" sub-mesh, no TP: FSDP reduces over half the world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    return fully_shard(_mlp(), mesh=mesh["dp"])  # type: ignore[no-any-return]


def _ddp_subgroup() -> torch.nn.Module:
    """DDP over this rank's 2-rank sub-group ({0, 1} or {2, 3}) of the 4-rank world."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    return torch.nn.parallel.DistributedDataParallel(_mlp(), process_group=groups[dist.get_rank() // 2])


def _fsdp2_world() -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    return fully_shard(_mlp(), mesh=mesh)  # type: ignore[no-any-return]


def _ddp_world() -> torch.nn.Module:
    return torch.nn.parallel.DistributedDataParallel(_mlp())


SCENARIOS: dict[str, tuple[Callable[[], torch.nn.Module], str]] = {
    "dp2_tp2_fsdp2": (_dp2_tp2, "auto"),
    "dp2_tp2_fsdp2_loss_scale": (_dp2_tp2, "loss_scale"),
    "fsdp2_dp_submesh": (_fsdp2_dp_submesh, "auto"),
    "ddp_subgroup": (_ddp_subgroup, "auto"),
    "ddp_subgroup_loss_scale": (_ddp_subgroup, "loss_scale"),
    "fsdp2_world": (_fsdp2_world, "auto"),
    "ddp_world": (_ddp_world, "auto"),
}


def attach_all() -> dict[str, str]:
    """Every scenario in turn on this rank: what ``hook.attach(model)`` said."""
    said: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (build, gradients) in SCENARIOS.items():
            model = build()
            hook = RebalanceHook(global_batch_size=8)
            try:
                hook.attach(model, gradients=gradients)
                said[name] = f"ATTACHED {hook.gradients}"
            except ValueError as exc:
                said[name] = f"REFUSED {exc}"
            finally:
                hook.close()
            dist.barrier()
    return said

"""Device meshes: which data-parallel replica this rank belongs to, and whether a model's
mesh matches the ``dp_mesh`` the hook was given (issue 24, docs/meshes.md).

With ``RebalanceHook(..., dp_mesh=M)`` shares are per data-parallel replica: the ranks
that share one coordinate in ``M`` (a tensor/context-parallel group) form one replica and
get the identical local batch. The hook then presents each replica to the rest of the
system as one worker: rank = replica index, world = number of replicas."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["replica_of", "check_dp_mesh"]


def _mesh_ranks(mesh: Any) -> set[int]:
    return {int(r) for r in mesh.mesh.flatten().tolist()}


def _names(mesh: Any) -> tuple[str, ...]:
    names = getattr(mesh, "mesh_dim_names", None)
    return tuple(names) if names else tuple(f"dim {d}" for d in range(mesh.ndim))


def replica_of(dp_mesh: Any) -> tuple[int, int, tuple[int, ...]]:
    """(replica index, number of replicas, global ranks of this rank's replica).

    The replica index is this rank's coordinate in ``dp_mesh`` flattened row-major. One
    blocking all-gather at start-up learns every rank's index, which checks that ``dp_mesh``
    tiles the world: every replica has the same number of ranks."""
    try:
        coord = dp_mesh.get_coordinate()
        shape = tuple(int(n) for n in dp_mesh.mesh.shape)
    except AttributeError:
        raise ValueError(
            f"dp_mesh must be a torch DeviceMesh of the data-parallel dimensions (mesh['dp'], or "
            f"the whole 2-D mesh for HSDP), got {type(dp_mesh).__name__}."
        ) from None
    world = dist.get_world_size()
    index, replicas = -1, 1
    for n in shape:
        replicas *= n
    if coord is not None:
        index = 0
        for c, n in zip(coord, shape, strict=True):
            index = index * n + int(c)
    # Every rank takes part before any raises, so that all of them raise instead of hanging.
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (index, replicas))
    outside = [r for r, e in enumerate(every) if e[0] < 0]
    if outside:
        raise ValueError(
            f"dp_mesh is not a sub-mesh of the world: ranks {outside} of the {world} are not in the "
            f"dp_mesh they passed ({_names(dp_mesh)}, ranks {sorted(_mesh_ranks(dp_mesh))} here); every "
            f"rank must pass its own data-parallel slice of one world mesh, e.g. mesh['dp']."
        )
    if any(e[1] != replicas for e in every) or world % replicas:
        raise ValueError(
            f"dp_mesh is not a sub-mesh of the world: ranks report data-parallel sizes "
            f"{sorted({e[1] for e in every})} for a world of {world}; every rank must pass its own "
            f"slice of one world mesh (mesh['dp'] or mesh[('dp_replicate', 'dp_shard')])."
        )
    members = tuple(r for r, e in enumerate(every) if e[0] == index)
    sizes = {sum(1 for e in every if e[0] == i) for i in range(replicas)}
    if sizes != {world // replicas}:
        raise ValueError(
            f"dp_mesh is not a sub-mesh of the world: its {replicas} replicas hold unequal numbers of "
            f"the {world} ranks ({sorted(sizes)}); every rank must pass its own slice of one world mesh."
        )
    return index, replicas, members


def check_dp_mesh(model: Any, dp_mesh: Any) -> None:
    """Refuse a model whose gradients are reduced over other ranks than ``dp_mesh``'s, or
    whose parameters are split over a dim that crosses data-parallel ranks."""
    from trainer_hook.gradients import (
        _fsdp2_modules,
        _is_ddp,
        _is_fsdp1,
        _mesh_dim_name,
        _ranks_along,
    )

    dp = _mesh_ranks(dp_mesh)
    dp_names = _names(dp_mesh)
    if _is_ddp(model) or _is_fsdp1(model):
        label = "DistributedDataParallel" if _is_ddp(model) else "FullyShardedDataParallel (FSDP1)"
        group = getattr(model, "process_group", None)
        ranks = set(dist.get_process_group_ranks(group)) if group is not None else set(range(dist.get_world_size()))
        if ranks != dp:
            raise ValueError(
                f"{label} reduces gradients over ranks {sorted(ranks)}, but dp_mesh {dp_names} holds "
                f"ranks {sorted(dp)}: wrap the model over dp_mesh.get_group() (the model's mesh and "
                f"dp_mesh must agree)."
            )
    for m in _fsdp2_modules(model):
        for group in m._get_fsdp_state()._fsdp_param_groups:
            mesh = group.mesh_info.mesh
            if _mesh_ranks(mesh) != dp:
                raise ValueError(
                    f"FSDP2 (fully_shard) reduces gradients over mesh {_names(mesh)} (ranks "
                    f"{sorted(_mesh_ranks(mesh))}), but dp_mesh {dp_names} holds ranks {sorted(dp)}: "
                    f"the model's mesh and dp_mesh must agree (fully_shard(mesh=mesh['dp']) with "
                    f"dp_mesh=mesh['dp'])."
                )
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return
    me = dist.get_rank()
    for pname, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        for d in range(mesh.ndim):
            along = _ranks_along(mesh, d)
            if len(along) <= 1 or along <= dp or along & dp == {me}:
                continue  # data parallel, or orthogonal to it (tensor/context parallel)
            raise ValueError(
                f"parameter {pname!r} is a DTensor over mesh dims {_names(mesh)}; dim "
                f"{_mesh_dim_name(mesh, d)!r} (ranks {sorted(along)}) crosses dp_mesh {dp_names} "
                f"(ranks {sorted(dp)}): the model's mesh and dp_mesh disagree."
            )

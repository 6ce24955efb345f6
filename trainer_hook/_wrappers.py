"""Which data-parallel wrapper a model is, and the set-ups the hook refuses.

Recognises DDP, FSDP1 and FSDP2 (through ``torch.compile``'s wrapper), and refuses, naming
what is supported, what cannot be balanced by batch share alone: DeepSpeed, pipeline
parallelism, HSDP, tensor/context-parallel meshes without ``dp_mesh`` and reductions over
part of the world (``check_data_parallel``, ``check_mesh``). No communication happens here.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainer_hook.mesh import mesh_dim_names, mesh_ranks

__all__ = ["check_data_parallel", "check_mesh"]


def _compiled_inner(model: Any) -> Any:
    """The module ``torch.compile`` wrapped (``OptimizedModule._orig_mod``), else ``model``:
    the wrapper runs the very module, so hooks registered on it apply."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) and type(model).__name__ == "OptimizedModule" else model


def _is_ddp(model: Any) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


_SUPPORTED_WRAPPERS = (
    "Supported: DistributedDataParallel, FSDP2 (fully_shard) and FSDP1 "
    "(FullyShardedDataParallel) over one data-parallel dimension, each through "
    "hook.attach(model)."
)
_SUPPORTED = (
    _SUPPORTED_WRAPPERS[:-1] + "; anything that averages gradients over all ranks through "
    "hook.attach(model, gradients='loss_scale') with loss * hook.loss_weight()."
)


def _pipeline_stage_of(model: Any) -> Any:
    """The ``torch.distributed.pipelining`` stage that holds ``model`` as its module, else
    None (looked for only where pipelining is imported; once, at attach)."""
    if "torch.distributed.pipelining" not in sys.modules:
        return None
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:
        return None
    inner = _compiled_inner(model)
    for holder in gc.get_referrers(model, inner) if inner is not model else gc.get_referrers(model):
        if isinstance(holder, _PipelineStageBase) and getattr(holder, "submod", None) in (model, inner):
            return holder
    return None


def _fsdp2_modules(model: torch.nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return []
    # fully_shard() swaps each module's class for a dynamically made "FSDP<Name>"
    # subclass of FSDPModule, so the class name alone says nothing.
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _is_fsdp1(model: Any) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return isinstance(model, FullyShardedDataParallel)


_NEEDS_DP_MESH = (
    "Tensor/context-parallel meshes, and data parallelism over part of the world, need "
    "RebalanceHook(..., dp_mesh=mesh['dp']) (the whole 2-D mesh for HSDP), which makes shares "
    "per data-parallel replica (docs/meshes.md); without it every rank of the world is its own "
    "data-parallel worker (DDP, FSDP1 or FSDP2 over the whole world)."
)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _ranks_along(mesh: Any, dim: int) -> set[int]:
    """The ranks of ``mesh`` that share this rank's coordinates in every dim but ``dim``
    (this rank's group along ``dim``), read from the mesh's rank tensor: no collective."""
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh
        return set()
    index: list[Any] = list(coord)
    index[dim] = slice(None)
    return {int(r) for r in mesh.mesh[tuple(index)].flatten().tolist()}


def _mesh_dim_name(mesh: Any, dim: int) -> str:
    names = getattr(mesh, "mesh_dim_names", None)
    return names[dim] if names else f"dim {dim}"


def _dtensor_dims(model: Any) -> Iterator[tuple[str, Any, Any, int, set[int]]]:
    """(name, parameter, its mesh, a dim of the mesh, the ranks along that dim through this
    rank) for every dim of every DTensor parameter; nothing on a torch without DTensor."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return
    for pname, p in model.named_parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            for d in range(mesh.ndim):
                yield pname, p, mesh, d, _ranks_along(mesh, d)


def check_mesh(model: Any, world_size: int | None = None) -> None:
    """Refuse, naming ``dp_mesh``, a model whose gradients are reduced over part of the
    world or whose parameters are split over a mesh dim that is not data parallel: the
    hook gives every rank of the world its own samples, so ranks of one tensor/context-
    parallel group would see different batches (issue 24; ``dp_mesh`` is not built yet)."""
    world = _world_size() if world_size is None else world_size
    if world <= 1:
        return
    inner = _compiled_inner(model)
    for label, group in (("DistributedDataParallel", getattr(inner, "process_group", None) if _is_ddp(inner)
                          else None),
                         ("FullyShardedDataParallel (FSDP1)", getattr(inner, "process_group", None)
                          if _is_fsdp1(inner) else None)):
        if group is not None and dist.get_world_size(group) != world:
            raise ValueError(
                f"Rebalancer balances data-parallel ranks only: {label} reduces gradients over a "
                f"process group of {dist.get_world_size(group)} of the {world} ranks, while the "
                f"hook splits each global batch over all {world}. {_NEEDS_DP_MESH}"
            )
    # The ranks FSDP2 reduces gradients over: the data-parallel ranks of this rank.
    dp_ranks: set[int] = set()
    fsdp_meshes = []
    for m in _fsdp2_modules(inner):
        for group in m._get_fsdp_state()._fsdp_param_groups:
            mesh = group.mesh_info.mesh
            fsdp_meshes.append(mesh)
            dp_ranks |= {int(r) for r in mesh.mesh.flatten().tolist()}
    for pname, p, mesh, dim, along in _dtensor_dims(inner):
        if len(along) <= 1 or along <= dp_ranks:
            continue
        names = tuple(_mesh_dim_name(mesh, d) for d in range(mesh.ndim))
        placements = ", ".join(repr(pl) for pl in p.placements)
        raise ValueError(
            f"Rebalancer balances data-parallel ranks only: parameter {pname!r} is a DTensor "
            f"over mesh dims {names} with placements ({placements}); mesh dim "
            f"{_mesh_dim_name(mesh, dim)!r} ({len(along)} ranks) is not data parallel "
            f"(tensor or context parallelism), and all its ranks must see the same samples. "
            f"{_NEEDS_DP_MESH}"
        )
    if fsdp_meshes and len(dp_ranks) != world:
        names = tuple(dict.fromkeys(
            _mesh_dim_name(mesh, d) for mesh in fsdp_meshes for d in range(mesh.ndim)))
        raise ValueError(
            f"Rebalancer balances data-parallel ranks only: FSDP2 (fully_shard) reduces gradients "
            f"over {len(dp_ranks)} of the {world} ranks (mesh dims {names}), while the hook splits "
            f"each global batch over all {world}. {_NEEDS_DP_MESH}"
        )


def check_data_parallel(model: Any, world_size: int | None = None, *, dp_mesh: Any = None,
                        pipelined: bool = False) -> None:
    """Refuse, naming what is supported, set-ups whose ranks are not all data-parallel
    replicas of one model (their gradients cannot be weighted by batch share alone); with
    ``dp_mesh``, a model whose mesh disagrees with it. ``pipelined``: the hook was given
    ``pp_mesh`` (trainer_hook.pipeline), so a pipeline stage's module is what it balances."""
    cls = type(model)
    name, module = cls.__name__, cls.__module__
    if module.startswith("deepspeed") or "DeepSpeedEngine" in name:
        raise ValueError(
            f"DeepSpeed ({name}) is not supported by the rebalancer: its engine reduces and "
            f"partitions gradients inside engine.backward()/step(), out of the hook's reach. {_SUPPORTED}"
        )
    stage = None if pipelined else _pipeline_stage_of(model)
    if not pipelined and (module.startswith("torch.distributed.pipelining") or "Pipe" in name or stage is not None):
        what = name if stage is None else f"the module of {type(stage).__name__} {getattr(stage, 'stage_index', '?')}"
        raise ValueError(
            f"pipeline parallelism ({what}) is not supported by the rebalancer: every stage of a "
            f"pipeline must see the same micro-batches, so no stage can take a different share, and "
            f"no gradient mechanism makes it right (gradients='loss_scale' included) unless the hook "
            f"knows the pipeline: create it with RebalanceHook(dp_mesh=mesh['dp'], pp_mesh=mesh['pp'], "
            f"micro_batches=M) and train through hook.pipeline_schedule(...) (docs/pipelines.md), "
            f"or train the model with data parallelism only. {_SUPPORTED_WRAPPERS}"
        )
    if dp_mesh is not None:
        check_dp_mesh(_compiled_inner(model), dp_mesh)
        return
    if _is_fsdp1(model):
        strategy = str(getattr(model, "sharding_strategy", "")).split(".")[-1]
        if "HYBRID" in strategy:
            raise ValueError(
                f"FSDP1 with {strategy} (HSDP) is not supported by the rebalancer: gradients are "
                f"reduce-scattered in a shard group, then all-reduced across replicas, and the hook "
                f"weights only one of the two. Use ShardingStrategy.FULL_SHARD. {_SUPPORTED}"
            )
        check_mesh(model, world_size)
        return
    fsdp2 = _fsdp2_modules(model)
    for m in fsdp2:
        for group in m._get_fsdp_state()._fsdp_param_groups:
            if type(group.mesh_info).__name__ != "FSDPMeshInfo" or group.mesh_info.mesh.ndim != 1:
                raise ValueError(
                    "FSDP2 over a device mesh with more than one dimension (HSDP, or FSDP with "
                    "tensor parallelism) is not supported by the rebalancer: only ranks that are "
                    f"pure data-parallel replicas can take different shares. {_SUPPORTED}"
                )
    if fsdp2:
        check_mesh(model, world_size)
        return
    dtensor_cls: Any = None
    try:
        from torch.distributed.tensor import DTensor as dtensor_cls
    except ImportError:
        pass
    if dtensor_cls is not None and any(isinstance(p, dtensor_cls) for p in model.parameters()):
        raise ValueError(
            "tensor parallelism (DTensor parameters outside FSDP) is not supported by the "
            "rebalancer: ranks that hold pieces of one model replica must see the same batch. "
            f"{_SUPPORTED} {_NEEDS_DP_MESH}"
        )
    check_mesh(model, world_size)


def check_dp_mesh(model: Any, dp_mesh: Any) -> None:
    """Refuse a model whose gradients are reduced over other ranks than ``dp_mesh``'s, or
    whose parameters are split over a dim that crosses data-parallel ranks."""
    dp = mesh_ranks(dp_mesh)
    dp_names = mesh_dim_names(dp_mesh)
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
            if mesh_ranks(mesh) != dp:
                raise ValueError(
                    f"FSDP2 (fully_shard) reduces gradients over mesh {mesh_dim_names(mesh)} (ranks "
                    f"{sorted(mesh_ranks(mesh))}), but dp_mesh {dp_names} holds ranks {sorted(dp)}: "
                    f"the model's mesh and dp_mesh must agree (fully_shard(mesh=mesh['dp']) with "
                    f"dp_mesh=mesh['dp'])."
                )
    me = dist.get_rank()
    for pname, _p, mesh, d, along in _dtensor_dims(model):
        if len(along) <= 1 or along <= dp or along & dp == {me}:
            continue  # data parallel, or orthogonal to it (tensor/context parallel)
        raise ValueError(
            f"parameter {pname!r} is a DTensor over mesh dims {mesh_dim_names(mesh)}; dim "
            f"{_mesh_dim_name(mesh, d)!r} (ranks {sorted(along)}) crosses dp_mesh {dp_names} "
            f"(ranks {sorted(dp)}): the model's mesh and dp_mesh disagree."
        )

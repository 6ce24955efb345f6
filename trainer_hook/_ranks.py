"""Ranks: who this process is in the job (rank, world size, its data-parallel replica),
read once from the process group; owns nothing that changes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from rebalancer_wire.protocol import MeshShape
from trainer_hook.config import HookConfig
from trainer_hook.mesh import Replicas, device_label, mesh_shape, replica_of


@dataclass(frozen=True, slots=True)
class Ranks:
    """This process's place in the job. With ``dp_mesh`` ``rank`` and ``world_size`` count
    data-parallel replicas (docs/meshes.md); ``global_world`` is the process group's size."""

    rank: int
    world_size: int
    global_world: int
    root: bool  # global rank 0: decides placements and their batch index
    leader: bool  # talks to the backend (a replica's first rank)
    members: int = 1  # ranks per replica (its tensor/context-parallel group)
    replica_ranks: tuple[int, ...] = ()
    replica_devices: tuple[str, ...] = ()  # each member's host and device
    mesh: MeshShape | None = None  # the job's mesh shape, for the hello
    replicas: Replicas | None = None


def read_ranks(config: HookConfig, dp_mesh: Any, where: str) -> Ranks:
    """This process's Ranks; ValueError when the global batch cannot give every rank a sample."""
    rank, world = _rank_and_world(where)
    ranks = Ranks(rank=rank, world_size=world, global_world=world, root=rank == 0, leader=True)
    if dp_mesh is not None:
        replicas = replica_of(dp_mesh, device_label())
        members = len(replicas.members)
        ranks = Ranks(rank=replicas.replica, world_size=replicas.replicas, global_world=world, root=rank == 0,
                      leader=dist.get_rank() == replicas.members[0], members=members,
                      replica_ranks=replicas.members, replica_devices=replicas.devices,
                      mesh=mesh_shape(dp_mesh, replicas.replicas, members), replicas=replicas)
    b = config.global_batch_size
    if b < ranks.world_size:
        raise ValueError(
            f"global_batch_size ({b}) must be at least the world size ({ranks.world_size}) "
            "so the uniform split gives every rank a sample."
        )
    return ranks


def env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def _rank_and_world(where: str) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = env_world_size()
    if world > 1:
        raise RuntimeError(
            f"{where} needs the process group, but WORLD_SIZE is {world} and torch.distributed "
            "is not initialised yet. The hook may be created first, but before using it create "
            "what starts the group: dist.init_process_group(...) in a torchrun script, the HF "
            "TrainingArguments (RebalancingTrainer) or the Accelerate Accelerator."
        )
    return 0, 1

"""Device meshes: which data-parallel replica this rank belongs to, and whether a model's
mesh matches the ``dp_mesh`` the hook was given (issue 24, docs/meshes.md).

With ``RebalanceHook(..., dp_mesh=M)`` shares are per data-parallel replica: the ranks
that share one coordinate in ``M`` (a tensor/context-parallel group) form one replica and
get the identical local batch. The hook then presents each replica to the rest of the
system as one worker: rank = replica index, world = number of replicas. A replica is as
slow as its slowest member: ``ReplicaPace`` combines the members' step records so that the
leader reports the replica's pace."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from trainer_hook.protocol import MeshShape, StepRecord

__all__ = ["Replicas", "replica_of", "mesh_shape", "check_dp_mesh", "ReplicaPace", "PACE_WINDOW"]


class Replicas(NamedTuple):
    """This rank's replica index, the number of replicas, its replica's global ranks, and
    every replica's global ranks (index order)."""

    replica: int
    replicas: int
    members: tuple[int, ...]
    every: tuple[tuple[int, ...], ...]


def _mesh_ranks(mesh: Any) -> set[int]:
    return {int(r) for r in mesh.mesh.flatten().tolist()}


def _names(mesh: Any) -> tuple[str, ...]:
    names = getattr(mesh, "mesh_dim_names", None)
    return tuple(names) if names else tuple(f"dim {d}" for d in range(mesh.ndim))


def replica_of(dp_mesh: Any) -> Replicas:
    """This rank's replica, and every replica's ranks.

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
    every_replica = tuple(tuple(r for r, e in enumerate(every) if e[0] == i) for i in range(replicas))
    return Replicas(index, replicas, members, every_replica)


def mesh_shape(dp_mesh: Any, replicas: int, replica_size: int) -> MeshShape:
    """The job's mesh for the hello: the dims of the mesh ``dp_mesh`` was sliced from
    (DeviceMesh's root mesh, when it covers the world), else ``dp_mesh``'s dims and one
    dim called "replica" for the rest."""
    root: Any = None
    try:
        root = dp_mesh._get_root_mesh()  # private in torch 2.x; absent: the fallback below
    except Exception:  # noqa: BLE001 - any torch without it
        root = None
    if root is not None and getattr(root, "mesh_dim_names", None):
        shape = tuple(int(n) for n in root.mesh.shape)
        if math.prod(shape) == replicas * replica_size:
            return MeshShape(dp=replicas, replica_size=replica_size, dims=tuple(root.mesh_dim_names), shape=shape)
    dims = tuple(n if n.isidentifier() else f"dp{i}" for i, n in enumerate(_names(dp_mesh)))
    shape = tuple(int(n) for n in dp_mesh.mesh.shape)
    if replica_size > 1:
        dims, shape = (*dims, "replica"), (*shape, replica_size)
    return MeshShape(dp=replicas, replica_size=replica_size, dims=dims, shape=shape)


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


# --- the replica's pace --------------------------------------------------------------------

PACE_WINDOW = 8  # batches per all-reduce: the launch and the read cost ~40 us, paid once per window
_NONE = float("-inf")  # a slot no member filled; every field is combined with MAX
_WIDTH = 8


def _row(rec: StepRecord) -> list[float]:
    # MAX for the times a slow member stretches, MAX of the negation for those it shrinks:
    # the slowest member waits least for peers, and the smallest device bounds memory.
    return [rec.compute_ms, rec.data_wait_ms, rec.optimizer_ms, rec.step_ms, -rec.sync_wait_ms,
            _NONE if rec.mem_peak_bytes is None else float(rec.mem_peak_bytes),
            _NONE if rec.mem_reserved_bytes is None else float(rec.mem_reserved_bytes),
            _NONE if rec.mem_total_bytes is None else -float(rec.mem_total_bytes)]


def _apply(rec: StepRecord, row: list[float]) -> None:
    if row[0] == _NONE:
        return
    rec.compute_ms, rec.data_wait_ms, rec.optimizer_ms, rec.step_ms = row[0], row[1], row[2], row[3]
    rec.sync_wait_ms = -row[4]
    if rec.mem_peak_bytes is not None:
        rec.mem_peak_bytes = int(row[5])
        rec.mem_reserved_bytes = int(row[6]) if row[6] != _NONE else rec.mem_reserved_bytes
        rec.mem_total_bytes = int(-row[7]) if row[7] != _NONE else rec.mem_total_bytes


class ReplicaPace:
    """A replica is as slow as its slowest member: the leader reports, for each step, the
    members' largest compute, data-wait, optimizer and step times, their smallest sync wait,
    and (where it read memory) their largest peak and smallest device.

    Every member files its StepRecord's times into a slot keyed by batch index (``add``).
    After every ``window`` batches (the training loop's count, the same on every member)
    all members launch one asynchronous all-reduce (MAX) of a finished window's slots on
    the replica's gloo group and read it one step later (``on_step_end``), so the training
    thread never waits for it and pays the launch once per window. The leader's records
    wait for their window and leave combined; a record that arrives after its window left
    (device timing events read late) leaves as measured. ``behind`` windows are left for
    such late records (1 with device events, 0 with host timestamps)."""

    def __init__(self, group: Any, *, leader: bool, window: int = PACE_WINDOW, behind: int = 0) -> None:
        self.group = group
        self.leader = leader
        self.window = window
        self.behind = behind
        self._rows: dict[int, list[list[float]]] = {}
        self._held: dict[int, list[StepRecord]] = {}
        self._next: int | None = None  # the first window not launched yet (set at the first step)
        self._inflight: tuple[int, int, Any, torch.Tensor] | None = None  # first window, count, work, buffer
        opts: Any = dist.AllreduceOptions()  # straight to the group: dist.all_reduce costs 2x
        opts.reduceOp = dist.ReduceOp.MAX
        self._opts = opts
        self.combined = 0  # records the leader reported as the replica's
        self.late = 0  # records the leader reported as measured (their window had left)

    def add(self, rec: StepRecord) -> list[StepRecord]:
        """File this member's record; returns what the leader reports now (only a late record)."""
        w = rec.batch_index // self.window
        if self._next is not None and w < self._next:
            self.late += self.leader
            return [rec] if self.leader else []
        rows = self._rows.get(w)
        if rows is None:
            rows = self._rows[w] = [[_NONE] * _WIDTH for _ in range(self.window)]
        rows[rec.batch_index - w * self.window] = _row(rec)
        if self.leader:
            self._held.setdefault(w, []).append(rec)
        return []

    def on_step_end(self, trained: int, late_records: bool) -> list[StepRecord]:
        """Every member, after every step (``trained``: the batches done): read the window in
        flight, launch the next one that is due. Returns the leader's combined records.
        ``late_records``: records come a step or more late (device events); read at the first
        step, where it is the same on every member (one device type)."""
        out: list[StepRecord] = []
        if self._next is None:  # the first step: the same batch on every member
            self._next = (trained - 1) // self.window
            self.behind = 1 if late_records else 0
        if self._inflight is not None:
            out = self._collect(None)
        if trained % self.window == 0:
            last = trained // self.window - 1 - self.behind
            if last >= self._next:
                self._launch(last)
        return out

    def flush(self, trained: int, timeout_s: float | None) -> list[StepRecord]:
        """At close, on every member after the same steps: combine all that is left (blocking)."""
        out = self._collect(timeout_s) if self._inflight is not None else []
        if self._next is not None and trained > 0 and (trained - 1) // self.window >= self._next:
            self._launch((trained - 1) // self.window)
            out += self._collect(timeout_s)
        return out + self.release()

    def release(self) -> list[StepRecord]:
        """Records still held (their window never left), as measured; forget the rest."""
        held = [r for w in sorted(self._held) for r in self._held[w]]
        self.late += len(held)
        self._held.clear()
        self._rows.clear()
        self._inflight = None
        return held

    def _launch(self, last: int) -> None:
        assert self._next is not None
        first, n = self._next, last - self._next + 1
        empty = [[_NONE] * _WIDTH] * self.window
        rows = [row for w in range(first, last + 1) for row in self._rows.pop(w, empty)]
        buf = torch.tensor(rows, dtype=torch.float64)
        work = self.group.allreduce([buf], self._opts) if self.group is not None else None
        self._inflight = (first, n, work, buf)
        self._next = last + 1

    def _collect(self, timeout_s: float | None) -> list[StepRecord]:
        assert self._inflight is not None
        first, n, work, buf = self._inflight
        self._inflight = None
        if work is not None:
            work.wait() if timeout_s is None else work.wait(timedelta(seconds=timeout_s))
        rows = buf.tolist()
        out: list[StepRecord] = []
        for w in range(first, first + n):
            for rec in self._held.pop(w, ()):
                _apply(rec, rows[(w - first) * self.window + rec.batch_index - w * self.window])
                out.append(rec)
        self.combined += len(out)
        return out

"""Device meshes: which data-parallel replica this rank belongs to, the mesh shape its hello
says and the replica's pace (docs/meshes.md); whether a model's mesh matches the ``dp_mesh``
the hook was given is ``_wrappers.check_dp_mesh``'s.

With ``RebalanceHook(..., dp_mesh=M)`` shares are per data-parallel replica: the ranks
that share one coordinate in ``M`` (a tensor/context-parallel group) form one replica and
get the identical local batch. The hook then presents each replica to the rest of the
system as one worker: rank = replica index, world = number of replicas. A replica is as
slow as its slowest member: ``ReplicaPace`` combines the members' step records so that the
leader reports the replica's pace."""

from __future__ import annotations

import logging
import math
import socket
import threading
from array import array
from collections.abc import Callable, Sequence
from queue import SimpleQueue
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from rebalancer_wire.protocol import MAX_NAME_CHARS, MeshShape, StepRecord

log = logging.getLogger("trainer_hook")

__all__ = ["Replicas", "replica_of", "device_label", "mesh_shape", "ReplicaPace", "PACE_WINDOW"]


class Replicas(NamedTuple):
    """This rank's replica index, the number of replicas and its replica's global ranks."""

    replica: int
    replicas: int
    members: tuple[int, ...]
    devices: tuple[str, ...] = ()  # each member's host and device, in the order of members


def mesh_ranks(mesh: Any) -> set[int]:
    return {int(r) for r in mesh.mesh.flatten().tolist()}


def mesh_dim_names(mesh: Any) -> tuple[str, ...]:
    names = getattr(mesh, "mesh_dim_names", None)
    return tuple(names) if names else tuple(f"dim {d}" for d in range(mesh.ndim))


def device_label() -> str:
    """This rank's host and device as a replica's member list shows it: "node-a NVIDIA H100
    80GB HBM3 #4" (the CUDA device the script selected), "node-a CPU" without CUDA."""
    host = socket.gethostname()
    try:
        if torch.cuda.is_available():
            i = torch.cuda.current_device()
            return f"{host} {torch.cuda.get_device_name(i)} #{i}"
    except Exception:  # noqa: BLE001 - a label is not worth failing the start for
        log.debug("the CUDA device could not be named", exc_info=True)
    return f"{host} CPU"


def replica_of(dp_mesh: Any, label: str = "") -> Replicas:
    """This rank's replica: its index, the number of replicas, its global ranks and their
    ``label`` (each member's ``device_label()``).

    The replica index is this rank's coordinate in ``dp_mesh`` flattened row-major. One
    blocking all-gather at start-up learns every rank's index and label, which checks that
    ``dp_mesh`` tiles the world: every replica has the same number of ranks."""
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
    dist.all_gather_object(every, (index, replicas, label[:MAX_NAME_CHARS]))  # as the wire takes it
    outside = [r for r, e in enumerate(every) if e[0] < 0]
    if outside:
        raise ValueError(
            f"dp_mesh is not a sub-mesh of the world: ranks {outside} of the {world} are not in the "
            f"dp_mesh they passed ({mesh_dim_names(dp_mesh)}, ranks {sorted(mesh_ranks(dp_mesh))} here); every "
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
    return Replicas(index, replicas, members, tuple(every[r][2] for r in members))


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
    dims = tuple(n if n.isidentifier() else f"dp{i}" for i, n in enumerate(mesh_dim_names(dp_mesh)))
    shape = tuple(int(n) for n in dp_mesh.mesh.shape)
    if replica_size > 1:
        dims, shape = (*dims, "replica"), (*shape, replica_size)
    return MeshShape(dp=replicas, replica_size=replica_size, dims=dims, shape=shape)


# --- the replica's pace --------------------------------------------------------------------

PACE_WINDOW = 8  # batches per all-reduce
_NONE = float("-inf")  # a slot no member filled; every field is combined with MAX
_WIDTH = 10  # compute, data wait, optimizer, step, -sync wait, peak, reserved, -device memory,
# the samples' fingerprint and its negation (MAX of both: equal magnitudes iff every member
# that filed the slot trained the same samples), then one compute time per member, each
# member filling its own (which one is slowest).
_FINGERPRINT_BITS = (1 << 52) - 1  # a fingerprint stays an exact float64
_CHECK_WAIT_S = 600.0  # the longest a member waits for a window's check (a peer's step)
_NOTHING: tuple[StepRecord, ...] = ()


# A pipeline rank's fwd, bwd, send wait, recv wait, bubble (PIPELINE_STAGE_FIELDS), then its
# data-parallel gradient wait and its compute_ms (not sent: they correct the pipeline's compute).
_STAGE_COLUMNS = 7


def _apply(rec: StepRecord, buf: array, i: int, members: Sequence[int], stages: int = 0) -> None:
    if buf[i] == _NONE:
        return
    if stages:  # a pipeline: each rank's stage columns, in stage order, after the members'
        j = i + _WIDTH + len(members)
        cols = [max(0.0, v) for v in buf[j:j + _STAGE_COLUMNS * stages]]  # a rank that filed nothing: 0
        fields = [tuple(cols[s * _STAGE_COLUMNS + c] for s in range(stages)) for c in range(_STAGE_COLUMNS)]
        rec.stage_fwd_ms, rec.stage_bwd_ms, rec.stage_send_wait_ms, rec.stage_recv_wait_ms, rec.stage_bubble_ms = \
            fields[:5]
        rec.n_microbatches = rec.local_batch_size
        dp_wait, compute = fields[5], fields[6]
    rec.compute_ms, rec.data_wait_ms, rec.optimizer_ms, rec.step_ms = buf[i], buf[i + 1], buf[i + 2], buf[i + 3]
    rec.sync_wait_ms = -buf[i + 4]
    if stages and all(compute):
        # A stage's last backward waits for the data-parallel reduction; the stages before it
        # then wait for its gradients, in their receives: that wait is the reduction's, not
        # the pipeline's. The pipeline's compute: the slowest stage without it.
        own = max(max(0.0, compute[s] - sum(dp_wait[s + 1:])) for s in range(stages))
        if own < rec.compute_ms:
            rec.sync_wait_ms += rec.compute_ms - own
            rec.compute_ms = own
    if stages and rec.stage_bubble_ms:
        rec.bubble_ms = min(sum(rec.stage_bubble_ms) / stages, rec.step_ms)
    if rec.mem_peak_bytes is not None:
        rec.mem_peak_bytes = int(buf[i + 5])
        if buf[i + 6] != _NONE:
            rec.mem_reserved_bytes = int(buf[i + 6])
        if buf[i + 7] != _NONE:
            rec.mem_total_bytes = int(-buf[i + 7])
    if members:  # each member's own compute time: the first with the largest is the slowest
        own = buf[i + _WIDTH:i + _WIDTH + len(members)]
        rec.slowest_rank = members[own.index(max(own))]


class ReplicaPace:
    """A replica is as slow as its slowest member: its leader reports, for each step, the
    members' largest compute, data-wait, optimizer and step times, their smallest sync wait
    (the slowest member waits least), where it read memory their largest peak and
    smallest device, and which member the compute time is (``slowest_rank``: each member
    also files its compute time in a column of its own, so the MAX all-reduce gathers
    every member's; given ``members``, the replica's global ranks, and ``position``, this
    member's index in them).

    The training thread only files each record's numbers into a slot of its window (a
    plain ``array``, keyed by batch index: ``add``) and, every ``window`` batches (the
    training loop's count, the same on every member), hands the finished window to this
    object's daemon thread (``on_step_end``). That thread all-reduces it (MAX) on the
    replica's gloo group, one window after another in the same order on every member,
    and calls ``report`` with the leader's records, combined. A record that comes after
    its window left (device timing events read late) is returned by ``add`` to be reported
    as measured; ``behind`` windows are left for such records (1 with device events).

    A pipeline (``stages`` ranks, this one at stage ``stage``): each member also files its
    stage's five numbers (``add(..., stage_ms=)``) in columns of its own, and the leader's
    records carry them as a pipeline leader's lists (docs/protocol.md)."""

    def __init__(self, group: Any, *, leader: bool, report: Callable[[Sequence[StepRecord]], None],
                 window: int = PACE_WINDOW, behind: int = 0, members: Sequence[int] = (),
                 position: int = 0, stages: int = 0, stage: int = 0) -> None:
        if members and not 0 <= position < len(members):
            raise ValueError(f"position must index members ({len(members)} of them), got {position}.")
        self.group = group
        self.leader = leader
        self.window = window
        self.behind = behind
        self.members = tuple(members)
        self._report = report
        self.stages = stages
        self._width = _WIDTH + len(self.members) + _STAGE_COLUMNS * stages  # values per batch in a window
        self._own = _WIDTH + position  # this member's compute column
        self._stage_col = _WIDTH + len(self.members) + _STAGE_COLUMNS * stage  # its stage's columns
        self._blank = array("d", [_NONE]) * (window * self._width)
        self._open: dict[int, tuple[array[float], list[StepRecord]]] = {}  # windows being filled
        self._next: int | None = None  # the first window not handed over (set at the first step)
        # (first window, its windows' slots and held records) per hand-over; None: stop.
        self._work: SimpleQueue[tuple[int, list[tuple[array, list[StepRecord]]]] | None] = SimpleQueue()
        self._thread: threading.Thread | None = None
        opts: Any = dist.AllreduceOptions()  # straight to the group: dist.all_reduce costs 2x
        opts.reduceOp = dist.ReduceOp.MAX
        self._opts = opts
        self.combined = 0  # records the leader reported as the replica's
        self.late = 0  # records the leader reported as measured
        # Hand-overs queued and combined: every member checks hand-over h's fingerprints at
        # hand-over h + 1 (the same batch on every member), so all raise at once.
        self._cond = threading.Condition()
        self._handed = 0
        self._checked = 0
        self.mismatch: str | None = None  # why the members trained different samples

    def add(self, rec: StepRecord, fingerprint: int = 0,
            stage_ms: Sequence[float] | None = None) -> Sequence[StepRecord]:
        """Training thread: file this member's record and the fingerprint of the samples it
        trained (``samples_fingerprint``). Returns what to report now (the leader's record
        whose window already left), else nothing."""
        k = rec.batch_index
        w = k // self.window
        if self._next is not None and w < self._next:
            if self.leader:
                self.late += 1
                return (rec,)
            return _NOTHING
        slot = self._open.get(w)
        if slot is None:
            slot = self._open[w] = (array("d", self._blank), [])
        buf, held = slot
        i = (k - w * self.window) * self._width
        buf[i], buf[i + 1], buf[i + 2], buf[i + 3] = rec.compute_ms, rec.data_wait_ms, rec.optimizer_ms, rec.step_ms
        buf[i + 4] = -rec.sync_wait_ms
        fp = float(fingerprint & _FINGERPRINT_BITS)
        buf[i + 8], buf[i + 9] = fp, -fp
        if self.members:
            buf[i + self._own] = rec.compute_ms
        if self.stages and stage_ms is not None:
            j = i + self._stage_col
            buf[j:j + _STAGE_COLUMNS] = array("d", stage_ms)
        if rec.mem_peak_bytes is not None:
            buf[i + 5] = rec.mem_peak_bytes
            if rec.mem_reserved_bytes is not None:
                buf[i + 6] = rec.mem_reserved_bytes
            if rec.mem_total_bytes is not None:
                buf[i + 7] = -rec.mem_total_bytes
        if self.leader:
            held.append(rec)
        return _NOTHING

    def on_step_end(self, trained: int, late_records: bool) -> None:
        """Training thread, every member, after every step (``trained``: the batches done).
        ``late_records``: records come a step or more late (device events); read at the
        first step, where it is the same on every member (one device type)."""
        if self._next is None:  # the first step: the same batch on every member
            self._next = (trained - 1) // self.window
            self.behind = 1 if late_records else 0
        if trained % self.window:
            return
        last = trained // self.window - 1 - self.behind
        if last >= self._next:
            self._check()
            self._hand_over(last)

    def _check(self) -> None:
        """Training thread, at a hand-over: wait until the earlier hand-overs are combined
        (they were launched a window ago: almost always done), then raise if the members
        trained different samples. Every member raises at the same batch, so no member is
        left waiting in a collective for one that stopped."""
        if self._handed:
            with self._cond:
                if not self._cond.wait_for(lambda: self._checked >= self._handed, _CHECK_WAIT_S):
                    log.warning("the replica's step times of a window were not combined within %.0f s; "
                                "going on without checking them", _CHECK_WAIT_S)
        if self.mismatch is not None:
            raise RuntimeError(self.mismatch)

    def flush(self, trained: int, timeout_s: float | None) -> Sequence[StepRecord]:
        """At close, on every member after the same steps: combine what is left and wait for
        the thread (at most ``timeout_s``). Returns records the thread could not take."""
        if self._next is not None and trained > 0 and (trained - 1) // self.window >= self._next:
            self._hand_over((trained - 1) // self.window)
        self._work.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the replica's last step times were not combined within %s s", timeout_s)
        if self.mismatch is not None:
            log.error("%s", self.mismatch)
        return self.release()

    def release(self) -> list[StepRecord]:
        """Stop: the records still filed here, as measured (the thread is told to end)."""
        self._work.put(None)
        held = [r for w in sorted(self._open) for r in self._open[w][1]]
        self._open.clear()
        self.late += len(held)
        return held

    def after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker): inert; the parent's thread, queue and group
        are left untouched (a lock held at the fork would never be released here)."""
        self.group = None
        self._thread = None
        self._work = SimpleQueue()
        self._open = {}
        self._next = 1 << 62  # every record is late: nothing is filed
        self._cond = threading.Condition()  # one held at the fork would never be released

    def _hand_over(self, last: int) -> None:
        assert self._next is not None
        first = self._next
        windows = [self._open.pop(w) if w in self._open else (array("d", self._blank), [])
                   for w in range(first, last + 1)]
        self._next = last + 1
        self._handed += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rebalancer-replica-pace", daemon=True)
            self._thread.start()
        self._work.put((first, windows))

    def _run(self) -> None:
        """The pace thread: one all-reduce per hand-over, in hand-over order on every member."""
        while (item := self._work.get()) is not None:
            first, windows = item
            buf = windows[0][0] if len(windows) == 1 else sum((b for b, _ in windows[1:]), array("d", windows[0][0]))
            held = [r for _, rs in windows for r in rs]
            try:
                if self.group is not None:
                    self.group.allreduce([torch.frombuffer(buf, dtype=torch.float64)], self._opts).wait()
            except Exception as exc:  # noqa: BLE001 - a peer gone or the group destroyed: report as measured
                log.debug("the replica's step times could not be combined: %s", exc)
                self.late += len(held)
                self._checked_up_to(1 << 62)  # nothing more is combined: nothing to wait for
                if held:
                    self._report(held)
                return
            self._compare(first, buf)
            for rec in held:
                w = rec.batch_index // self.window
                _apply(rec, buf, ((w - first) * self.window + rec.batch_index - w * self.window) * self._width,
                       self.members, self.stages)
            self.combined += len(held)
            if held:
                self._report(held)
            self._checked_up_to(self._checked + 1)

    def _checked_up_to(self, n: int) -> None:
        with self._cond:
            self._checked = n
            self._cond.notify_all()

    def _compare(self, first: int, buf: array) -> None:
        """Pace thread: the first batch of these windows whose members filed different
        fingerprints (after MAX, ``fp`` and ``-(-fp)`` differ) is a mismatch."""
        if self.mismatch is not None:
            return
        for j in range(len(buf) // self._width):
            i = j * self._width
            if buf[i + 8] != _NONE and buf[i + 8] != -buf[i + 9]:
                who = f"ranks {list(self.members)}" if self.members else "its ranks"
                self.mismatch = (
                    f"the members of one data-parallel replica ({who}) trained different samples at "
                    f"batch {first * self.window + j}: every rank of a replica (its tensor- or "
                    "context-parallel group) must train the identical local batch. Build the loader "
                    "with hook.data_loader(...) or hook.batch_sampler(...) with the same shuffle and "
                    "seed on every rank, and give every rank its slice of one world mesh as dp_mesh."
                )
                return

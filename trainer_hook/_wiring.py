"""The one place that builds a RebalanceHook's components and wires them together, once
the process group is there (the torchtitan way: the trainer holds its parts, each part
takes what it needs as constructor arguments). A new component is built here and held by
``Components``; the facade (trainer_hook.hook) forwards to it.

Who calls whom, in the order built: Ranks (who this process is) -> the placement schedule
and the ControlChannel (rank 0's placements to every rank) -> Weighting (gradients) ->
Placements (offers, start-up, the placement in force, acks) -> MicroSteps -> StepLoop
(the hot path; calls Placements, Weighting, MicroSteps, Connection) -> Loading (sampler
into the StepLoop) -> Checkpoints (reads and restores StepLoop, Placements, MicroSteps).
The Connection is built before the process group (it keeps the history) and started here."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from rebalancer_wire.protocol import Hello
from trainer_hook._announce import say_start, start_line
from trainer_hook._checkpoint import Checkpoints
from trainer_hook._connection import Connection, host_facts
from trainer_hook._loading import Loading
from trainer_hook._micro_steps import MicroSteps
from trainer_hook._placements import Placements
from trainer_hook._ranks import Ranks, read_ranks
from trainer_hook._steps import StepLoop
from trainer_hook._weights import Weighting
from trainer_hook.channel import ControlChannel
from trainer_hook.config import HookConfig
from trainer_hook.gradients import GradientState
from trainer_hook.memory import MemoryMeter
from trainer_hook.mesh import PACE_WINDOW, ReplicaPace
from trainer_hook.phases import GcSchedule, PhaseClock
from trainer_hook.pipeline import PIPELINE_PACE_WINDOW, PipelineSchedules
from trainer_hook.placement import PlacementSchedule
from trainer_hook.timing import StepTimer

log = logging.getLogger("trainer_hook")
_UNMEASURED = 1 << 40  # lookahead before the first step measures it: nothing is final yet


@dataclass(frozen=True, slots=True)
class Before:
    """What a hook holds from its constructor on, before the process group exists."""

    config: HookConfig
    dp_mesh: Any
    connection: Connection
    grads: GradientState
    phases: PhaseClock
    timer: StepTimer
    memory: MemoryMeter | None
    gc_schedule: GcSchedule | None
    training_thread: int
    pipeline: PipelineSchedules | None = None  # pp_mesh given (trainer_hook.pipeline)


@dataclass(frozen=True, slots=True)
class Components:
    """A wired hook's parts; each owns its state (see each module's first line)."""

    ranks: Ranks
    schedule: PlacementSchedule
    channel: ControlChannel
    pace: ReplicaPace | None
    weighting: Weighting
    placements: Placements
    micro: MicroSteps
    loop: StepLoop
    loading: Loading
    checkpoints: Checkpoints
    connect: Callable[[], None]  # start talking to the backend (a pipeline's: at its first step)

    def ensure_started(self) -> None:
        """Once, on every rank: the placement in force agreed before the first batch."""
        self.placements.ensure_started(self.loop.next_batch)

    def hello(self, before: Before) -> Hello:
        """What this rank says about itself on connecting (and after attach)."""
        cfg, ranks, mesh = before.config, self.ranks, self.ranks.mesh
        device_type, device_name, mem_total, gpu_index, gpu_uuid = before.connection.describe_device()
        return Hello(
            job=cfg.job_name, rank=ranks.rank, world_size=ranks.world_size,
            global_batch_size=cfg.global_batch_size, **host_facts(),
            device_type=device_type, device_name=device_name,
            mem_total_bytes=mem_total, placement_version=self.placements.trained.version,
            batch_index=self.loop.next_batch, total_steps=cfg.total_steps,
            memory_source=before.memory.source.name if before.memory is not None else "",
            gpu_index=gpu_index, gpu_uuid=gpu_uuid, comm_kind=self.weighting.comm_kind, mesh=mesh,
            replica_ranks=ranks.replica_ranks if mesh is not None else (),
            replica_devices=ranks.replica_devices if mesh is not None else (),
            mode=cfg.mode or "", micro_batches=cfg.micro_batches is not None,
            pipeline=before.pipeline.shape(ranks.rank) if before.pipeline is not None else None,
        )


def build(before: Before, where: str) -> Components:
    """Join the process group (a gloo control group, a replica's own group) and wire the parts."""
    cfg = before.config
    ranks = read_ranks(cfg, before.dp_mesh, where)
    pipeline = before.pipeline
    if pipeline is not None:  # every pipeline is a replica of dp_mesh; shares count micro-batches
        pipeline.bind(ranks.rank, ranks.replica_ranks, ranks.world_size, cfg.micro_batches)
    schedule = PlacementSchedule(ranks.world_size, cfg.global_batch_size)
    group = dist.new_group(backend="gloo") if ranks.global_world > 1 else None
    # Measured: settle nothing in particular until the first step agrees on it; no
    # exchange can start a placement before then.
    given = cfg.lookahead if isinstance(cfg.lookahead, int) else None
    channel = ControlChannel(
        rank=0 if ranks.root else 1 + ranks.rank, world_size=ranks.world_size, schedule=schedule,
        exchange_every=cfg.exchange_every, exchange_lag=cfg.exchange_lag,
        lookahead=given if given is not None else _UNMEASURED, group=group,
    )
    conn = before.connection
    pace = None
    if ranks.replicas is not None and ranks.members > 1:
        members = ranks.replicas.members
        mine = _replica_group(members, group)
        pace = ReplicaPace(mine, leader=ranks.leader, report=conn.report_many, members=members,
                           position=members.index(dist.get_rank()),
                           # A pipeline's leader reports its stages' times too, every 4 steps.
                           stages=pipeline.pp_size if pipeline is not None else 0,
                           stage=pipeline.pp_rank if pipeline is not None else 0,
                           window=PIPELINE_PACE_WINDOW if pipeline is not None else PACE_WINDOW)
    weighting = Weighting(config=cfg, ranks=ranks, grads=before.grads, channel=channel, connection=conn,
                          dp_mesh=before.dp_mesh, pipelined=pipeline is not None)
    placements = Placements(config=cfg, ranks=ranks, schedule=schedule, channel=channel, connection=conn,
                            weighting=weighting, share_rule=pipeline.check_shares if pipeline is not None else None)
    micro = MicroSteps(config=cfg, rank=ranks.rank, weighting=weighting)
    loop = StepLoop(config=cfg, rank=ranks.rank, schedule=schedule, channel=channel, placements=placements,
                    weighting=weighting, micro=micro if cfg.micro_batches is not None else None,
                    connection=conn, grads=before.grads, timer=before.timer, memory=before.memory,
                    gc_schedule=before.gc_schedule, pace=pace, pipeline=pipeline)
    parts: Components

    def start() -> None:
        parts.ensure_started()

    loading = Loading(config=cfg, rank=ranks.rank, schedule=schedule, phases=before.phases, loop=loop, start=start)
    checkpoints = Checkpoints(config=cfg, ranks=ranks, schedule=schedule, channel=channel, placements=placements,
                              loop=loop, micro=micro, connection=conn)
    def connect() -> None:
        if not cfg.offline and ranks.leader and conn.transport is None:  # only a replica's leader talks to the backend
            conn.start(hello=lambda: parts.hello(before), on_message=placements.on_message, where=loop.where,
                       training_thread=before.training_thread)

    parts = Components(ranks=ranks, schedule=schedule, channel=channel, pace=pace, weighting=weighting,
                       placements=placements, micro=micro, loop=loop, loading=loading, checkpoints=checkpoints,
                       connect=connect)
    if ranks.global_world == 1 or (dist.is_available() and dist.is_initialized() and dist.get_rank() == 0):
        unit = "ranks" if before.dp_mesh is None else "data-parallel replicas"
        say_start(start_line(cfg, ranks.world_size, unit))  # one line for the job, from rank 0
    if pipeline is None:  # a pipeline's leader connects once its first step names the schedule
        connect()
    return parts


def _replica_group(members: tuple[int, ...], control: Any) -> Any:
    """The replica's own gloo group, where its members' step times meet; made by its members
    only (no world-wide call or barrier per replica, and no NCCL no-colour split on the
    ranks outside it when the default group is bound to a device).

    Not ``dist.new_group(members, use_local_synchronization=True)``: torch names that group
    sha1(ranks, number of live groups), so a second hook built after the first closed (fit
    twice, a notebook cell run again) gets the same name, and gloo's rendezvous reads the
    closed group's addresses still in the store under it ("Connection refused"). Here the
    store prefix carries the control group's name, torch's count of the groups every rank
    made, which never comes back while the default group lives: a gloo backend of its own,
    used straight (ReplicaPace calls its allreduce), shut down by close_groups."""
    rank_of = sorted(members)
    prefix = f"rebalancer/replica/{control.group_name}/{'_'.join(map(str, rank_of))}/"
    store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
    return dist.ProcessGroupGloo(store, rank_of.index(dist.get_rank()), len(rank_of),
                                 timeout=dist.default_pg_timeout)


def close_groups(parts: Components, grads: GradientState) -> None:
    """Destroy the hook's own gloo groups now and drop the cached gradient group.

    A process group that Python still references outlives destroy_process_group() and is
    torn down during interpreter finalisation, where gloo's worker threads can abort the
    process (SIGABRT, "terminate called without an active exception"); so both die while
    the interpreter is whole."""
    grads._pg = None
    grads._opts = None
    group, parts.channel.group = parts.channel.group, None
    pace_group = None
    if parts.pace is not None:
        pace_group, parts.pace.group = parts.pace.group, None
    if pace_group is not None:  # not in torch's registry (_replica_group): shut it down here
        try:
            pace_group.shutdown()
        except RuntimeError as exc:
            log.debug("the replica group was already shut down: %s", exc)
    if group is not None and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError) as exc:  # already gone with the default group
            log.debug("control group was already destroyed: %s", exc)

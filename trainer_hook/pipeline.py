"""Pipelines: each data-parallel pipeline of a PP x DP job trains its own number of
micro-batches (``RebalanceHook(pp_mesh=..., dp_mesh=..., micro_batches=M)``).

A placement's shares count micro-batches of one fixed size, one share per pipeline; every
stage of a pipeline runs the same ones: pipeline ``i`` trains positions
``sum(shares[:i]) .. sum(shares[:i+1]) - 1`` of the step's M micro-batches. The schedule
(``torch.distributed.pipelining``: ``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``) is built for the pipeline's count and built again at the step
boundary where a new placement changes it, on every stage of the pipeline at once (the
placement switch is the hook's, on all ranks at the same batch index). Each micro-batch's
gradient counts 1/M of the step (the hook's gradient weight; the schedule must not divide,
``scale_grads=False``), so a pipeline's gradient is weighted by its share before the
data-parallel reduction and the step trains the mean over the global batch. A drained
pipeline (share 0) runs the fewest micro-batches its schedule takes with weight 0, so it
still joins the data-parallel reduction.

Each stage's schedule call is timed by ``trainer_hook._stage_clock`` (forward and backward
per micro-batch, send and receive waits, the bubble); the pipeline's leader reports all its
stages' (``ReplicaPace``). A stage's ``compute_ms`` is the schedule's run without the
data-parallel gradient wait, p2p waits included: a stage waiting on its neighbours is the
pipeline's pace, not a peer's.

Layers (stage-split advice, docs/pipelines.md): at the first step every stage of a pipeline
says which layers it holds, and the hello carries ``layers_per_stage`` and ``layer_names``
for the whole pipeline. A stage's layers are the ``layers=`` names given to
``hook.pipeline_schedule`` or else, torchtitan style, the entries of its module's ``layers``
container (a ``ModuleDict``: ``layers.<key>``; a ``ModuleList``: numbered in model order).
Per-layer times are not measured: the advice spreads a stage's measured time evenly over
its layers.

Interleaved (``ScheduleInterleaved1F1B``): a rank passes the list of its stages (model stages
``rank, rank + PP, ...``) and ``hook.attach`` took the list of their modules; the count must
be a multiple of the schedule's rounds (``check_count``, the backend's ``takes_count``).

One module, over 400 lines on purpose: the schedule's checks, build at the step boundary,
run and layer gathering share one state (the stages, the count built, the run in progress);
cut apart, each piece would reach into the others' fields.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rebalancer_wire.protocol import PIPELINE_SCHEDULES, PipelineShape
from trainer_hook._stage_clock import StageClock, StageTimes
from trainer_hook.gradients import GradientState
from trainer_hook.mesh import mesh_ranks

__all__ = ["SCHEDULES", "PipelineRun", "PipelineSchedules", "StageTimes", "check_count", "fewest_micro_batches",
           "stage_layers"]

SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B")
PIPELINE_PACE_WINDOW = 4  # steps per combination of a pipeline's stage times (ReplicaPace)
_WIRE_NAMES = dict(zip(SCHEDULES, PIPELINE_SCHEDULES, strict=True))  # hello.pipeline.schedule
_SUPPORTED = ("Supported: ScheduleGPipe and Schedule1F1B (one PipelineStage per rank) and "
              "ScheduleInterleaved1F1B (a list of stages per rank) from torch.distributed.pipelining.")
# Schedules torch has that the hook does not balance, and why (a refusal names it).
_WHY_NOT = {
    "ScheduleLoopedBFS": "its count rules and its bubble are not modelled (every forward of a model stage "
                         "before the next, so activations grow with the count)",
    "ScheduleInterleavedZeroBubble": "it splits backward into input and weight parts whose times the hook "
                                     "does not measure apart, so its bubble cannot be modelled",
    "ScheduleZBVZeroBubble": "the same as ScheduleInterleavedZeroBubble (V-shaped stage placement)",
    "ScheduleDualPipeV": "the same as ScheduleInterleavedZeroBubble (V-shaped stage placement)",
}


def schedule_name(schedule_cls: Any) -> str:
    """Which supported schedule ``schedule_cls`` is (a subclass counts as its base), or ValueError."""
    from torch.distributed.pipelining import schedules as s

    if isinstance(schedule_cls, type):
        for name in SCHEDULES:
            if issubclass(schedule_cls, getattr(s, name)):
                return name
    shown = schedule_cls.__name__ if isinstance(schedule_cls, type) else repr(schedule_cls)
    why = next((f" ({text})" for base, text in _WHY_NOT.items() if isinstance(schedule_cls, type)
                and any(k.__name__ == base for k in schedule_cls.__mro__)), "")
    raise ValueError(f"hook.pipeline_schedule() cannot balance the pipeline schedule {shown}{why}. {_SUPPORTED}")


def fewest_micro_batches(name: str, pp_size: int) -> int:
    """The fewest micro-batches a pipeline of ``pp_size`` ranks may train per step under
    schedule ``name`` (a drained pipeline runs this many, with weight 0)."""
    return pp_size if name == "Schedule1F1B" else 1


def check_count(name: str, n: int, pp_size: int) -> str | None:
    """Why schedule ``name`` refuses ``n`` micro-batches per step (None: it takes them)."""
    if n < 0:
        return f"a pipeline cannot train {n} micro-batches."
    if n == 0:
        return None  # drained: runs fewest_micro_batches() with weight 0
    if name == "Schedule1F1B" and n < pp_size:
        return (f"Schedule1F1B needs at least as many micro-batches as stages ({pp_size}) per pipeline, "
                f"got {n}: give every pipeline 0 (drained) or at least {pp_size}, or use ScheduleGPipe.")
    if name == "ScheduleInterleaved1F1B":
        rounds = max(1, n // pp_size)
        if n % rounds:
            ok = sorted({m for m in range(max(1, n - pp_size), n + pp_size + 1) if m % max(1, m // pp_size) == 0})
            return (f"ScheduleInterleaved1F1B with {pp_size} ranks per pipeline needs a count that is a "
                    f"multiple of its rounds (count // {pp_size}), got {n}; nearby counts it takes: {ok}.")
    return None


class PipelineRun:
    """What ``hook.pipeline_schedule(...)`` returns for the step being trained.

    ``schedule``: the torch schedule for this pipeline's count (``n_microbatches``);
    ``micro_batches``: the positions, within the step's M micro-batches, this pipeline
    trains (a drained pipeline's are placeholders with weight 0); ``drained``; call
    ``step(*args, target=..., losses=...)`` once per step (it calls ``schedule.step``)."""

    def __init__(self, owner: PipelineSchedules, schedule: Any, positions: list[int], drained: bool) -> None:
        self._owner = owner
        self.schedule = schedule
        self.micro_batches = positions
        self.drained = drained
        self.ran = False

    @property
    def n_microbatches(self) -> int:
        return len(self.micro_batches)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """``schedule.step(*args, **kwargs)`` for this step, timed; once per step."""
        if self.ran:
            raise RuntimeError("the pipeline schedule of this step ran already: call run.step() once per hook.step().")
        self.ran = True
        return self._owner._run(self, args, kwargs)


class PipelineSchedules:
    """The pipeline side of a RebalanceHook: builds each step's schedule, times its stages."""

    def __init__(self, pp_mesh: Any, grads: GradientState) -> None:
        if not hasattr(pp_mesh, "get_group") or getattr(pp_mesh, "ndim", None) != 1:
            raise ValueError(f"pp_mesh must be the 1-D DeviceMesh of the pipeline dimension (mesh['pp']), "
                             f"got {type(pp_mesh).__name__}.")
        self.pp_mesh = pp_mesh
        self.pp_size = int(pp_mesh.size())
        self.pp_rank = int(pp_mesh.get_local_rank())
        self._grads = grads
        self.clock = StageClock()
        self.name: str | None = None  # the schedule's name, once known
        self._key: tuple[Any, ...] | None = None
        self._built: tuple[tuple[int, tuple[int, ...]], Any] | None = None  # ((count, shares), schedule)
        self._run_now: PipelineRun | None = None
        self._stages: list[Any] = []
        self._loss_fn: Callable[..., Any] = lambda *a, **kw: None
        self._scale_locally = False  # one pipeline, no data-parallel reduction to weight
        self._count = 0  # micro-batches the last run trained (0: drained)
        self.replica = 0  # this rank's pipeline (its dp index), set by bind()
        self._k = 0  # the batch index of the step in progress (or the last)
        self._shares: tuple[int, ...] | None = None  # the placement in force, inside a step only
        self.layers: tuple[tuple[str, ...], ...] = ()  # every stage's layer names (empty: none said)

    # --- checks ---------------------------------------------------------------------

    def bind(self, replica: int, members: Sequence[int], replicas: int, micro_batches: int | None) -> None:
        """At start-up: this rank's pipeline (its data-parallel replica: index and ranks);
        ValueError unless the replica is the pipeline and shares count micro-batches."""
        self.replica = replica
        if micro_batches is None:
            raise ValueError("RebalanceHook(pp_mesh=...) needs micro-batch placements: pass micro_batches=M, the "
                             "micro-batches of one optimizer step over all pipelines (shares count them).")
        pp = mesh_ranks(self.pp_mesh)
        if not members:
            raise ValueError("RebalanceHook(pp_mesh=...) needs dp_mesh too: RebalanceHook(dp_mesh=mesh['dp'], "
                             "pp_mesh=mesh['pp'], micro_batches=M).")
        if set(members) != pp:
            raise ValueError(
                f"the data-parallel replica of this rank (ranks {sorted(members)}, from dp_mesh) is not its pipeline "
                f"(ranks {sorted(pp)}, from pp_mesh): the hook balances PP x DP meshes whose dims are exactly "
                f"'pp' and 'dp' (tensor parallelism inside a stage is not supported here).")
        if micro_batches < replicas:
            raise ValueError(f"micro_batches ({micro_batches}) must be at least the number of pipelines ({replicas}).")

    def shape(self, dp_index: int) -> PipelineShape | None:
        """The hello's ``pipeline`` (None until the first step names the schedule)."""
        if self.name is None:
            return None
        n_stages = self.pp_size * max(1, len(self._stages))
        floor = self.pp_size if self.name == "Schedule1F1B" else 0  # 0: a pipeline may be drained
        counts = tuple(len(names) for names in self.layers) if any(self.layers) else ()
        names = tuple(n for names in self.layers for n in names) if counts else ()
        return PipelineShape(pp_size=self.pp_size, pp_stage=self.pp_rank, dp_index=dp_index, tp_size=1,
                             schedule=_WIRE_NAMES[self.name], n_stages=n_stages, min_microbatches=floor,
                             layers_per_stage=counts, layer_names=names)

    def check_shares(self, shares: Sequence[int]) -> str | None:
        """Why the schedule refuses a placement (once the schedule is known), else None."""
        if self.name is None:
            return None
        for i, n in enumerate(shares):
            why = check_count(self.name, int(n), self.pp_size)
            if why is not None:
                return f"pipeline {i}: {why}"
        return None

    # --- the step -------------------------------------------------------------------

    # --- the step (the step loop calls step_begins, step_ends, check_step, stage_columns) --

    @property
    def in_step(self) -> bool:
        return self._shares is not None

    def step_begins(self, batch_index: int, shares: Sequence[int]) -> None:
        self._k, self._shares, self._run_now = batch_index, tuple(shares), None

    def step_ends(self) -> None:
        self._shares = None

    def stage_columns(self, grads: GradientState, batch_index: int, compute_ms: float) -> tuple[float, ...] | None:
        """After the step (``grads.collect()`` done): what this stage files in its pipeline's
        pace for ``batch_index``: the five wire numbers, the data-parallel wait, its compute."""
        t = self.clock.finish(grads, self._k, self._stages, self._count)
        if t is None or t.batch_index != batch_index:
            return None
        return (*t.columns(), t.dp_wait_ms, compute_ms)

    def schedule_for(self, stages: Any, schedule_cls: Any, loss_fn: Callable[..., Any] | None,
                     kwargs: dict[str, Any], *, scale_locally: bool,
                     layers: Sequence[str] | Sequence[Sequence[str]] | None = None) -> PipelineRun:
        name = schedule_name(schedule_cls)
        stage_list = self._check_stages(stages, name)
        if kwargs.get("scale_grads", False):
            raise ValueError(
                "hook.pipeline_schedule() builds the schedule with scale_grads=False: the hook weights each "
                "micro-batch's gradient 1/M of the step (M micro-batches over all pipelines); a schedule that "
                "divides by its own count would weigh pipelines with different counts wrongly. Drop scale_grads "
                "and return the per-micro-batch mean loss from loss_fn.")
        if loss_fn is None:
            raise ValueError("hook.pipeline_schedule() trains: pass loss_fn (the per-micro-batch mean loss).")
        # loss_fn may be a new lambda every step: the schedule calls the newest one given.
        self._loss_fn = loss_fn
        key = (tuple(id(s) for s in stage_list), schedule_cls, tuple(sorted(kwargs)))
        if self._key is not None and key != self._key:
            raise ValueError("hook.pipeline_schedule() was given other stages, schedule class or options than "
                             "in earlier steps: pass the same ones every step.")
        if self._key is None:  # the first step, on every stage of the pipeline at once
            self.layers = self._gather_layers(_local_layers(stage_list, layers))
        self._key, self.name, self._stages = key, name, stage_list
        shares, replica = self._shares, self.replica
        if shares is None:
            raise RuntimeError("hook.pipeline_schedule() is called inside `with hook.step():`, once per step.")
        if self._run_now is not None:
            raise RuntimeError("hook.pipeline_schedule() was called twice in one step: call it once per step.")
        count = int(shares[replica])
        why = check_count(name, count, self.pp_size)
        if why is not None:
            raise ValueError(f"pipeline {replica}'s share of the placement in force cannot run: {why}")
        drained = count == 0
        n = fewest_micro_batches(name, self.pp_size) if drained else count
        # Any change of the shares rebuilds every pipeline's schedule: its first step infers
        # metadata with a forward, which under FSDP2 all-gathers over the dp dim, so every
        # pipeline must run it at the same step.
        build = (n, tuple(int(s) for s in shares))
        if self._built is None or self._built[0] != build:
            for st in stage_list:
                self.clock.watch(st)
            timed_loss = self.clock.timed_loss(lambda *a, **kw: self._loss_fn(*a, **kw))
            first = stage_list if name == "ScheduleInterleaved1F1B" else stage_list[0]
            try:
                sched = schedule_cls(first, n_microbatches=n, loss_fn=timed_loss, scale_grads=False, **kwargs)
            except ValueError as exc:
                raise ValueError(f"{name} refused {n} micro-batches for pipeline {replica}: {exc}") from None
            self._built = (build, sched)
        start = sum(int(s) for s in shares[:replica])
        positions = [j % max(1, sum(shares)) for j in range(n)] if drained else list(range(start, start + n))
        self._run_now = PipelineRun(self, self._built[1], positions, drained)
        self._scale_locally = scale_locally
        return self._run_now

    def check_step(self) -> None:
        """At the end of a step that did not fail: its schedule ran."""
        run, self._run_now = self._run_now, None
        if run is None or not run.ran:
            raise RuntimeError(
                f"step {self._k} ended without its pipeline schedule: with pp_mesh every step calls "
                "run = hook.pipeline_schedule(...) and run.step(...) inside `with hook.step():`.")

    def _run(self, run: PipelineRun, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        grads = self._grads
        # DDP's forward outside no_sync arms its reducer: the schedule's metadata inference
        # (the first step of each schedule built) runs one, so the first micro-batch's backward
        # would all-reduce too. The schedule arms the reducer for the last backward itself.
        ddps = [st.submod for st in self._stages if isinstance(st.submod, DistributedDataParallel)]
        for ddp in ddps:
            ddp.require_backward_grad_sync = False
        # FSDP2: pipelines run different numbers of micro-batches, and each forward of a
        # module resharded after forward all-gathers: parameters stay unsharded through the
        # step (one all-gather per module and step on every pipeline; the schedule's
        # reduce-grad reshards), each module's own setting back afterwards.
        saved = _keep_unsharded(self._stages)
        try:
            with self.clock.schedule_call():
                out = run.schedule.step(*args, **kwargs)
        finally:
            for ddp in ddps:
                ddp.require_backward_grad_sync = True
            _restore(saved)
        self._count = 0 if run.drained else run.n_microbatches
        if self._scale_locally and grads.weight != 1.0:
            with torch.no_grad():  # one pipeline, no reduction: what the comm hook's weighting does
                for st in self._stages:
                    for p in st.submod.parameters():
                        if p.grad is not None:
                            p.grad.mul_(grads.weight)
        return out

    @property
    def last(self) -> StageTimes | None:
        """The newest step's times of this stage."""
        return self.clock.last

    # --- internals ------------------------------------------------------------------

    def _gather_layers(self, mine: list[tuple[int, tuple[str, ...], bool]]) -> tuple[tuple[str, ...], ...]:
        """Every model stage's layer names, in stage order (one gather over the pipeline's
        ranks; an interleaved rank says one entry per stage it holds). A ``ModuleList``'s
        local indices are renumbered in model order across the stages."""
        got: list[Any] = [None] * self.pp_size
        if self.pp_size > 1:
            dist.all_gather_object(got, mine, group=self.pp_mesh.get_group())
        else:
            got = [mine]
        stages = sorted((entry for rank in got for entry in rank), key=lambda e: e[0])
        if any(numbered for _, _, numbered in stages):
            at, out = 0, []
            for _, names, numbered in stages:
                out.append(tuple(f"layers.{at + i}" for i in range(len(names))) if numbered else names)
                at += len(names)
            return tuple(out)
        return tuple(names for _, names, _ in stages)

    def _check_stages(self, stages: Any, name: str) -> list[Any]:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        stage_list = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        if not stage_list or not all(isinstance(s, _PipelineStageBase) for s in stage_list):
            raise ValueError("hook.pipeline_schedule() expects this rank's PipelineStage (or, for "
                             f"ScheduleInterleaved1F1B, a list of them), got {type(stages).__name__}.")
        if name != "ScheduleInterleaved1F1B" and len(stage_list) != 1:
            raise ValueError(f"{name} runs one stage per rank, got {len(stage_list)}. {_SUPPORTED}")
        pp_ranks = sorted(mesh_ranks(self.pp_mesh))
        for st in stage_list:
            group = st.group
            ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else list(
                range(dist.get_world_size()))
            if ranks != pp_ranks:
                raise ValueError(
                    f"stage {st.stage_index} sends over ranks {ranks}, but pp_mesh holds ranks {pp_ranks}: build "
                    f"PipelineStage(..., group=mesh['pp'].get_group()) (the stage's group and pp_mesh must agree).")
        want = self.pp_size * len(stage_list)
        if int(stage_list[0].num_stages) != want:
            raise ValueError(
                f"{name} with {len(stage_list)} stage(s) per rank over pp_mesh of {self.pp_size} ranks needs "
                f"{want} stages in all, but the stages say num_stages={stage_list[0].num_stages}.")
        if len(stage_list) > 1:
            loop = [self.pp_rank + i * self.pp_size for i in range(len(stage_list))]
            got = [int(st.stage_index) for st in stage_list]
            if got != loop:
                raise ValueError(
                    f"{name} places model stage i on pipeline rank i % {self.pp_size} (loop order): pipeline rank "
                    f"{self.pp_rank} holds stages {loop}, in that order, but was given stages {got}.")
        return stage_list


def _local_layers(stages: Sequence[Any], given: Any) -> list[tuple[int, tuple[str, ...], bool]]:
    """This rank's stages' layers, each with its stage index: ``given`` is one stage's list
    of names, or (several stages per rank) one such list per stage, in the order given."""
    if len(stages) == 1:
        return [(int(stages[0].stage_index), *stage_layers(stages[0], given))]
    if given is not None and (isinstance(given, str) or len(given) != len(stages)
                              or any(isinstance(g, str) for g in given)):
        raise ValueError(f"hook.pipeline_schedule(layers=...) with {len(stages)} stages on this rank takes one list "
                         f"of layer module names per stage, in the order of the stages given, got {given!r:.120}.")
    return [(int(st.stage_index), *stage_layers(st, None if given is None else given[i]))
            for i, st in enumerate(stages)]


def stage_layers(stage: Any, given: Sequence[str] | None) -> tuple[tuple[str, ...], bool]:
    """This stage's layer names, and whether they are a ``ModuleList``'s local numbers:
    ``given`` (``hook.pipeline_schedule(..., layers=[...])``), else the entries of the stage
    module's ``layers`` (torchtitan: a ``ModuleDict`` keyed by the layer's index in the whole
    model), else none."""
    if given is not None:
        if isinstance(given, str) or not all(isinstance(n, str) and n for n in given):
            raise ValueError(f"hook.pipeline_schedule(layers=...) takes this stage's layer module names, a list of "
                             f"non-empty strings (torchtitan's 'layers.0', ...), got {given!r}.")
        return tuple(given), False
    mod = stage.submod
    while isinstance(mod, DistributedDataParallel):
        mod = mod.module
    found = getattr(mod, "layers", None)
    if isinstance(found, torch.nn.ModuleDict):
        return tuple(f"layers.{k}" for k in found.keys()), False
    if isinstance(found, (torch.nn.ModuleList, torch.nn.Sequential)):
        return tuple(f"layers.{i}" for i in range(len(found))), True
    return (), False


def _keep_unsharded(stages: Sequence[Any]) -> list[tuple[Any, Any, Any]]:
    """Turn FSDP2's reshard-after-forward off for the step; returns what to restore."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return []
    saved: list[tuple[Any, Any, Any]] = []
    for st in stages:
        if not isinstance(st.submod, FSDPModule):
            continue
        root: Any = st.submod
        for m in root.modules():
            if isinstance(m, FSDPModule):
                state = m._get_fsdp_state()
                saved.append((state, state._auto_reshard_after_forward,
                              [(g, g.post_forward_mesh_info) for g in state._fsdp_param_groups]))
        root.set_reshard_after_forward(False)
    return saved


def _restore(saved: list[tuple[Any, Any, Any]]) -> None:
    for state, auto, groups in saved:
        state._auto_reshard_after_forward = auto
        for group, info in groups:
            group.post_forward_mesh_info = info

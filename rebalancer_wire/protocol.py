"""Wire protocol between the training hook and the backend (version 2; version 1 accepted).

Every frame is one JSON object (a websocket text frame) with two envelope keys:
``type`` (the message kind) and ``v`` (the protocol version). The models here are plain
dataclasses so that the hook depends on nothing but the standard library for them; the
backend imports the same classes, so both ends validate with one piece of code.

Hook -> backend: ``hello``, ``metrics``, ``ack``, ``reject``, ``oom``.
Backend -> hook: ``placement``, ``error``.

Version 2 added the peak-memory fields of step records, ``hello.memory_source`` and the
``oom`` message. A version-1 frame is still accepted (its fields are a subset); the backend
answers each connection in the version its ``hello`` spoke.

See docs/protocol.md for the conversation and the close codes.

One module, over 400 lines on purpose: every wire message, its ranges and its codec, so
that both ends validate with the same code and docs/protocol.md is checked against one
place."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, TypeAlias

_fast_loads: Callable[[str | bytes], Any] | None
try:  # the backend's extra: 3.5x faster on the frames of thousands of ranks
    from orjson import loads as _fast_loads
except ImportError:  # a hook-only install: the standard library's parser for everything
    _fast_loads = None

__all__ = [
    "next_placement_version",
    "MAX_NAME_CHARS",
    "check_job_name",
    "JOB_NAME_PATTERN",
    "HELLO_MODES",
    "STEP_FIELDS",
    "COMM_KINDS",
    "LINK_FIELDS",
    "STEP_TIMES",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "MAX_MESSAGE_BYTES",
    "MAX_RECORDS_PER_MESSAGE",
    "MAX_WORLD_SIZE",
    "MAX_GLOBAL_BATCH_SIZE",
    "MAX_BATCH_INDEX",
    "MAX_VERSION",
    "MAX_COUNT",
    "MAX_BYTES",
    "MAX_DURATION_MS",
    "MAX_WORK_SQ",
    "MAX_LENGTH_SQ_WEIGHT",
    "MAX_AGE_S",
    "MAX_AHEAD_S",
    "MAX_BATCH_JUMP",
    "CLOSE_NORMAL",
    "CLOSE_GOING_AWAY",
    "CLOSE_TOO_BIG",
    "CLOSE_UNSUPPORTED_VERSION",
    "CLOSE_MALFORMED",
    "CLOSE_UNAUTHORIZED",
    "CLOSE_FORBIDDEN",
    "CLOSE_CONFLICT",
    "CLOSE_RATE_LIMITED",
    "CLOSE_TRY_AGAIN_LATER",
    "CLOSE_REDIRECT",
    "ProtocolError",
    "Hello",
    "MeshShape",
    "MAX_MESH_DIMS",
    "PipelineShape",
    "PIPELINE_SCHEDULES",
    "MAX_PP_STAGES",
    "MAX_LAYERS",
    "PIPELINE_STAGE_FIELDS",
    "StepRecord",
    "DeviceSample",
    "Metrics",
    "Hang",
    "HANG_PHASES",
    "MAX_STACK_CHARS",
    "MAX_PATH_CHARS",
    "Ack",
    "Reject",
    "Oom",
    "Leave",
    "MAX_RANKS_PER_CONNECTION",
    "Placement",
    "Error",
    "Message",
    "encode",
    "decode",
    "decode_versioned",
    "parse",
    "check_shares",
    "uniform_shares",
]

PROTOCOL_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
MAX_MESSAGE_BYTES = 1 << 20
MAX_RECORDS_PER_MESSAGE = 2048
MAX_WORLD_SIZE = 65536
MAX_GPU_INDEX = 4095  # NVML device index; a node has far fewer GPUs
MAX_NAME_CHARS = 128  # a name or short label on the wire (host, device, replica_devices)
_MAX_TEXT = 2048

# Ranges of the numbers on the wire (docs/protocol.md, "Ranges"). Both ends validate with
# these; the backend adds the checks that need the connection's hello and its clock
# (``Metrics.check_against``). Counters and indices fit the int32 columns they are stored in.
_INT32_MAX = 2**31 - 1
MAX_GLOBAL_BATCH_SIZE = 1 << 24  # 16,777,216 samples per global batch
MAX_BATCH_INDEX = _INT32_MAX  # 68 years at one step a second
MAX_VERSION = _INT32_MAX  # placement versions and proposal ids
MAX_COUNT = _INT32_MAX  # dropped (per frame), restart_count, pid
MAX_WORK = 1e15  # summed per-sample cost of one global batch (tokens, say)
MAX_WORK_SQ = 1e30  # summed squared sample lengths of one global batch (MAX_WORK squared)
MAX_LENGTH_SQ_WEIGHT = 1e6  # k of a fitted cost L + k*L^2, per token
MAX_BYTES = 1 << 53  # 8 PiB; exact in a double, so browsers read it unchanged
MAX_DURATION_MS = 86_400_000.0  # one day, for every per-step time
_MAX_UNIX_TIME = 1e10  # year 2286: the context-free bound on ``t``
MAX_AGE_S = 7 * 86400.0  # ``t`` at most a week behind the backend's clock ...
MAX_AHEAD_S = 3600.0  # ... and at most an hour ahead of it
_MAX_PCT = 100.0
_MAX_CPU_PCT = 100.0 * MAX_WORLD_SIZE  # a process may use many cores
_MAX_POWER_W = 100_000.0
_MAX_TEMP_C = 1000.0
_MAX_CLOCK_MHZ = 100_000.0

MAX_RANKS_PER_CONNECTION = 256  # a node connection (docs/protocol.md) speaks for at most this many ranks
# A step's batch index is at most this far from its rank's last on the connection (the hello's
# batch_index, then the highest sent): 6x the hook's default queue of records held offline,
# and 18 hours at one step a second. A run resumed from a checkpoint says so in a new hello.
MAX_BATCH_JUMP = 1 << 16
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_TOO_BIG = 1009
CLOSE_UNSUPPORTED_VERSION = 4001
CLOSE_MALFORMED = 4002
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_CONFLICT = 4409  # hello for a job running with another shape
CLOSE_RATE_LIMITED = 4429  # more frames or bytes than the connection's budget
CLOSE_TRY_AGAIN_LATER = 1013  # the backend holds as many live jobs as it may
CLOSE_REDIRECT = 4307  # another replica controls the job: the ``error`` before it (code
# ``redirect``) carries that replica's URL in its message; the hook reconnects there


class ProtocolError(ValueError):
    """A frame that does not follow the protocol. ``code`` is a short machine-readable
    word sent back in an ``error`` message, ``close_code`` the websocket close code."""

    def __init__(self, message: str, *, code: str = "malformed", close_code: int = CLOSE_MALFORMED):
        super().__init__(message)
        self.code = code
        self.close_code = close_code


# --- field checks ------------------------------------------------------------------------


def _int(obj: Mapping[str, Any], key: str, *, lo: int = 0, hi: int, default: Any = ...) -> Any:
    if key not in obj or obj[key] is None:
        if default is ...:
            raise ProtocolError(f"'{key}' is required.")
        return default
    val = obj[key]
    if isinstance(val, bool) or not isinstance(val, int):
        raise ProtocolError(f"'{key}' must be an integer, got {type(val).__name__}.")
    if not lo <= val <= hi:
        raise ProtocolError(f"'{key}' must be between {lo} and {hi}, got {_short(val)}.")
    return val


def _bool(obj: Mapping[str, Any], key: str, *, default: Any = ...) -> Any:
    if key not in obj or obj[key] is None:
        if default is ...:
            raise ProtocolError(f"'{key}' is required.")
        return default
    val = obj[key]
    if not isinstance(val, bool):
        raise ProtocolError(f"'{key}' must be true or false, got {type(val).__name__}.")
    return val


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else repr(x)


def _short(val: Any) -> str:
    text = repr(val)
    return text if len(text) <= 40 else f"a number of {len(text)} digits"


def _float(obj: Mapping[str, Any], key: str, *, lo: float = 0.0, hi: float, default: Any = ...) -> Any:
    if key not in obj or obj[key] is None:
        if default is ...:
            raise ProtocolError(f"'{key}' is required.")
        return default
    val = obj[key]
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        raise ProtocolError(f"'{key}' must be a number, got {type(val).__name__}.")
    try:
        val = float(val)
    except OverflowError:  # an integer beyond a double
        raise ProtocolError(f"'{key}' must be a number between {_num(lo)} and {_num(hi)}, got {_short(val)}.") from None
    if not (math.isfinite(val) and lo <= val <= hi):
        raise ProtocolError(f"'{key}' must be a number between {_num(lo)} and {_num(hi)}, got {val}.")
    return val


def _str(obj: Mapping[str, Any], key: str, *, max_len: int = MAX_NAME_CHARS, default: Any = ..., nonempty: bool = False) -> Any:
    if key not in obj or obj[key] is None:
        if default is ...:
            raise ProtocolError(f"'{key}' is required.")
        return default
    val = obj[key]
    if not isinstance(val, str):
        raise ProtocolError(f"'{key}' must be a string, got {type(val).__name__}.")
    if len(val) > max_len:
        raise ProtocolError(f"'{key}' must be at most {max_len} characters, got {len(val)}.")
    if "\x00" in val:  # PostgreSQL text cannot hold it: the frame would fail in SQL, not here
        raise ProtocolError(f"'{key}' must not contain the NUL character (\\u0000).")
    if nonempty and not val.strip():
        raise ProtocolError(f"'{key}' must not be empty.")
    return val


def _list(obj: Mapping[str, Any], key: str, *, max_len: int = MAX_RECORDS_PER_MESSAGE, default: Any = ...) -> Any:
    if key not in obj or obj[key] is None:
        if default is ...:
            raise ProtocolError(f"'{key}' is required.")
        return default
    val = obj[key]
    if not isinstance(val, list):
        raise ProtocolError(f"'{key}' must be a list, got {type(val).__name__}.")
    if len(val) > max_len:
        raise ProtocolError(f"'{key}' holds {len(val)} items; at most {max_len} are allowed.")
    return val


def _obj(val: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(val, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {type(val).__name__}.")
    return val


# The job-name rule as a pattern (the backend's OpenAPI document states it): no '/', '?',
# '#', '\\', no surrounding whitespace, not empty. ``_job`` applies it, with its sentence.
JOB_NAME_PATTERN = r"^[^/?#\\\s]([^/?#\\]*[^/?#\\\s])?$"
_JOB_NAME = re.compile(JOB_NAME_PATTERN)


def _job(obj: Mapping[str, Any]) -> str:
    job = _str(obj, "job", nonempty=True)
    if not _JOB_NAME.fullmatch(job):
        raise ProtocolError(f"'job' may not contain '/', '?', '#', '\\' or surrounding spaces, got {job!r}.")
    return job


def check_job_name(job: str) -> str:
    """The protocol's one job-name rule (what a ``hello`` may name), for callers outside a
    frame (the backend's token creation); ``ProtocolError`` (a ``ValueError``) when refused."""
    return _job({"job": job})


def check_shares(shares: Sequence[Any], *, world_size: int, global_batch_size: int) -> list[int]:
    """Return ``shares`` as a list of ints, or raise ValueError saying what is wrong.

    A valid placement has one non-negative integer share per rank summing to the global
    batch size. Used by the backend before it sends and by the hook before it applies.
    """
    if not isinstance(shares, (list, tuple)):
        raise ValueError(f"shares must be a list of integers, got {type(shares).__name__}.")
    if len(shares) != world_size:
        raise ValueError(f"shares has {len(shares)} entries but the job has world_size {world_size}.")
    out: list[int] = []
    for i, s in enumerate(shares):
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"shares[{i}] must be an integer, got {s!r}.")
        if s < 0:
            raise ValueError(f"shares[{i}] must be >= 0, got {s}.")
        out.append(s)
    total = sum(out)
    if total != global_batch_size:
        raise ValueError(f"shares sum to {total} but the global batch size is {global_batch_size}.")
    if world_size > 0 and not any(out):
        raise ValueError("shares must give at least one rank a sample.")
    return out


def uniform_shares(world_size: int, global_batch_size: int) -> list[int]:
    """The version-0 split: as even as integers allow, the remainder to the lowest ranks."""
    if world_size <= 0:
        raise ValueError(f"world_size must be > 0, got {world_size}.")
    if global_batch_size < world_size:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) must be >= world_size ({world_size})."
        )
    q, r = divmod(global_batch_size, world_size)
    return [q + (1 if i < r else 0) for i in range(world_size)]


def next_placement_version(*seen: int | None) -> int:
    """The one numbering rule of placements, on both sides: one past the newest version seen
    (None: none), 0 when nothing was seen. A hook refuses a version not newer than its own."""
    known = [v for v in seen if v is not None]
    return max(known) + 1 if known else 0


# --- messages ----------------------------------------------------------------------------

MAX_MESH_DIMS = 8  # torchtitan's deepest mesh (pp, dp_replicate, dp_shard, cp, tp, ep) has 6
_MESH_DIM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")


@dataclass(frozen=True, slots=True)
class MeshShape:
    """A device-mesh job's shape, as its hooks say it in ``hello.mesh`` (docs/meshes.md).

    ``dp`` data-parallel replicas (the hello's ``world_size``: the hook speaks for one
    replica) of ``replica_size`` ranks each (its tensor/context-parallel group); ``dims``
    and ``shape`` name and size the dimensions of the whole mesh, whose product is
    ``dp * replica_size``. ``label`` is how people read it: "DP 2 x TP 2"."""

    dp: int
    replica_size: int
    dims: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def label(self) -> str:
        return " x ".join(f"{name.upper()} {n}" for name, n in zip(self.dims, self.shape, strict=True))

    def to_dict(self) -> dict[str, Any]:
        return {"dp": self.dp, "replica_size": self.replica_size, "dims": list(self.dims), "shape": list(self.shape)}

    def as_view(self) -> dict[str, Any]:
        """What the backend's job resource and dashboard show: the wire dict and its label."""
        return {**self.to_dict(), "label": self.label}

    @classmethod
    def from_dict(cls, d: Any, *, world_size: int) -> MeshShape:
        m = _obj(d, "'mesh'")
        dp, replica = (_mesh_int(m, key) for key in ("dp", "replica_size"))
        if dp != world_size:
            raise ProtocolError(
                f"'mesh.dp' ({dp}) must equal 'world_size' ({world_size}): with a mesh the hook "
                f"speaks for one data-parallel replica, so world_size counts replicas.")
        if dp * replica > MAX_WORLD_SIZE:
            raise ProtocolError(
                f"'mesh.dp' x 'mesh.replica_size' ({dp} x {replica}) must be at most {MAX_WORLD_SIZE} ranks.")
        dims, shape = m.get("dims"), m.get("shape")
        if not isinstance(dims, list) or not 1 <= len(dims) <= MAX_MESH_DIMS:
            raise ProtocolError(f"'mesh.dims' must be a list of 1 to {MAX_MESH_DIMS} dimension names, got {_short(dims)}.")
        for name in dims:
            if not isinstance(name, str) or not _MESH_DIM_NAME.fullmatch(name):
                raise ProtocolError(
                    f"'mesh.dims' holds {_short(name)}; a dimension name is 1 to 32 letters, digits or "
                    f"'_', not starting with a digit (e.g. 'dp', 'tp').")
        if len(set(dims)) != len(dims):
            raise ProtocolError(f"'mesh.dims' names a dimension twice: {dims}.")
        if (not isinstance(shape, list) or len(shape) != len(dims)
                or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_WORLD_SIZE for n in shape)):
            raise ProtocolError(
                f"'mesh.shape' must be a list of {len(dims)} sizes (one per name in 'mesh.dims') "
                f"between 1 and {MAX_WORLD_SIZE}, got {_short(shape)}.")
        if math.prod(shape) != dp * replica:
            raise ProtocolError(
                f"'mesh.shape' {shape} holds {math.prod(shape)} ranks, but 'mesh.dp' x 'mesh.replica_size' "
                f"is {dp} x {replica} = {dp * replica}.")
        return cls(dp=dp, replica_size=replica, dims=tuple(dims), shape=tuple(shape))


def _mesh_int(m: Mapping[str, Any], key: str) -> int:
    val = m.get(key)
    if isinstance(val, bool) or not isinstance(val, int) or not 1 <= val <= MAX_WORLD_SIZE:
        raise ProtocolError(f"'mesh.{key}' must be an integer between 1 and {MAX_WORLD_SIZE}, got {_short(val)}.")
    return val


def _replica_ranks(d: Mapping[str, Any], mesh: MeshShape | None) -> tuple[int, ...]:
    got = d.get("replica_ranks")
    if got is None or got == []:
        return ()
    if mesh is None:
        raise ProtocolError("'replica_ranks' comes with 'mesh' only: a plain data-parallel rank is its own replica.")
    world = mesh.dp * mesh.replica_size
    if (not isinstance(got, list) or len(got) != mesh.replica_size
            or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world for r in got)
            or len(set(got)) != len(got)):
        raise ProtocolError(
            f"'replica_ranks' must list the replica's {mesh.replica_size} distinct global ranks "
            f"('mesh.replica_size'), each between 0 and {world - 1}, got {_short(got)}.")
    return tuple(got)


def _replica_devices(d: Mapping[str, Any], members: tuple[int, ...]) -> tuple[str, ...]:
    got = d.get("replica_devices")
    if got is None or got == []:
        return ()
    if not members:
        raise ProtocolError("'replica_devices' comes with 'replica_ranks' only: one device per member.")
    if (not isinstance(got, list) or len(got) != len(members)
            or any(not isinstance(x, str) or len(x) > MAX_NAME_CHARS or "\x00" in x for x in got)):
        raise ProtocolError(
            f"'replica_devices' must list one string per member of 'replica_ranks' ({len(members)}), "
            f"in the same order, each at most {MAX_NAME_CHARS} characters without NUL, got {_short(got)}.")
    return tuple(got)


# --- pipelines (docs/pipelines.md) -----------------------------------------------------

# The schedules of torch.distributed.pipelining a pipelined hook may name (Hello.pipeline).
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
MAX_PP_STAGES = 4096  # pipeline ranks per pipeline; torchtitan's largest runs use 64
MAX_STAGES_PER_RANK = 64  # virtual stages (model chunks) per pipeline rank
MAX_LAYERS = 16384  # layers a model is split into, over all its stages


@dataclass(frozen=True, slots=True)
class PipelineShape:
    """A pipelined job's shape, as a pipeline's leader says it in ``hello.pipeline``.

    The hook speaks for one data-parallel pipeline (a replica, docs/meshes.md): the hello's
    ``rank`` is the pipeline's dp index (``dp_index``) and ``world_size`` the number of
    pipelines; ``pp_size`` pipeline ranks (stages on ranks) of ``tp_size`` tensor-parallel
    ranks each run it. ``pp_stage`` is the stage of the rank that speaks (the leader: 0).
    ``n_stages`` counts model stages (chunks): ``pp_size`` for GPipe and 1F1B, a multiple of
    it for interleaved 1F1B (stage ``k`` runs on pipeline rank ``k % pp_size``).
    ``min_microbatches`` is the fewest micro-batches per step the hook's schedule accepts on
    a pipeline (0: a pipeline may be drained). ``layers_per_stage`` (optional) counts the
    layers of each model stage and ``layer_names`` (optional, with it) names them in model
    order, torchtitan's module names ("tok_embeddings", "layers.0", ..., "output")."""

    pp_size: int
    pp_stage: int
    dp_index: int
    tp_size: int
    schedule: str
    n_stages: int
    min_microbatches: int
    layers_per_stage: tuple[int, ...] = ()
    layer_names: tuple[str, ...] = ()

    @property
    def stages_per_rank(self) -> int:
        return self.n_stages // self.pp_size

    @property
    def label(self) -> str:
        tp = f" x TP {self.tp_size}" if self.tp_size > 1 else ""
        virtual = f" ({self.stages_per_rank} stages per rank)" if self.stages_per_rank > 1 else ""
        return f"PP {self.pp_size}{tp}, {self.schedule}{virtual}"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"pp_size": self.pp_size, "pp_stage": self.pp_stage, "dp_index": self.dp_index,
                             "tp_size": self.tp_size, "schedule": self.schedule, "n_stages": self.n_stages,
                             "min_microbatches": self.min_microbatches}
        if self.layers_per_stage:
            d["layers_per_stage"] = list(self.layers_per_stage)
        if self.layer_names:
            d["layer_names"] = list(self.layer_names)
        return d

    @classmethod
    def from_dict(cls, d: Any, *, rank: int, world_size: int, global_batch_size: int,
                  mesh: MeshShape | None) -> PipelineShape:
        m = _obj(d, "'pipeline'")
        pp = _pipe_int(m, "pp_size", lo=1, hi=MAX_PP_STAGES)
        stage = _pipe_int(m, "pp_stage", lo=0, hi=MAX_PP_STAGES - 1, default=0)
        if stage >= pp:
            raise ProtocolError(
                f"'pipeline.pp_stage' ({stage}) must be below 'pipeline.pp_size' ({pp}): stages are "
                f"numbered 0 to {pp - 1}.")
        dp_index = _pipe_int(m, "dp_index", lo=0, hi=MAX_WORLD_SIZE - 1, default=rank)
        if dp_index != rank:
            raise ProtocolError(
                f"'pipeline.dp_index' ({dp_index}) must equal 'rank' ({rank}): a pipelined hook speaks "
                f"for one data-parallel pipeline, so its rank is the pipeline's dp index.")
        tp = _pipe_int(m, "tp_size", lo=1, hi=MAX_WORLD_SIZE, default=1)
        schedule = m.get("schedule")
        if schedule not in PIPELINE_SCHEDULES:
            raise ProtocolError(
                f"'pipeline.schedule' must be one of {', '.join(PIPELINE_SCHEDULES)}, got {_short(schedule)}.")
        n_stages = _pipe_int(m, "n_stages", lo=1, hi=MAX_PP_STAGES * MAX_STAGES_PER_RANK, default=pp)
        if schedule == "interleaved1f1b":
            if n_stages % pp or not 2 <= n_stages // pp <= MAX_STAGES_PER_RANK:
                raise ProtocolError(
                    f"'pipeline.n_stages' ({n_stages}) must be 2 to {MAX_STAGES_PER_RANK} times 'pipeline.pp_size' "
                    f"({pp}) for interleaved1f1b: each pipeline rank runs that many model stages.")
        elif n_stages != pp:
            raise ProtocolError(
                f"'pipeline.n_stages' ({n_stages}) must equal 'pipeline.pp_size' ({pp}) for {schedule}: one "
                f"model stage per pipeline rank (interleaved1f1b runs several).")
        if world_size * pp * tp > MAX_WORLD_SIZE:
            raise ProtocolError(
                f"'world_size' x 'pipeline.pp_size' x 'pipeline.tp_size' ({world_size} x {pp} x {tp}) must be "
                f"at most {MAX_WORLD_SIZE} ranks.")
        if mesh is not None and mesh.replica_size % (pp * tp):
            raise ProtocolError(
                f"'mesh.replica_size' ({mesh.replica_size}) must be a multiple of 'pipeline.pp_size' x "
                f"'pipeline.tp_size' ({pp} x {tp}): a pipeline's ranks are its replica.")
        floor = _pipe_int(m, "min_microbatches", lo=0, hi=MAX_GLOBAL_BATCH_SIZE, default=1)
        if floor * world_size > global_batch_size:
            raise ProtocolError(
                f"'pipeline.min_microbatches' ({floor}) x 'world_size' ({world_size} pipelines) is more than "
                f"'global_batch_size' ({global_batch_size} micro-batches): no placement could give every "
                f"pipeline its minimum.")
        layers = _pipe_ints(m, "layers_per_stage", n=n_stages)
        names = _layer_names(m, layers)
        return cls(pp_size=pp, pp_stage=stage, dp_index=dp_index, tp_size=tp, schedule=schedule,
                   n_stages=n_stages, min_microbatches=floor, layers_per_stage=layers, layer_names=names)


def _pipe_int(m: Mapping[str, Any], key: str, *, lo: int, hi: int, default: Any = ...) -> int:
    val = m.get(key)
    if val is None and default is not ...:
        return int(default)
    if isinstance(val, bool) or not isinstance(val, int) or not lo <= val <= hi:
        raise ProtocolError(f"'pipeline.{key}' must be an integer between {lo} and {hi}, got {_short(val)}.")
    return val


def _pipe_ints(m: Mapping[str, Any], key: str, *, n: int) -> tuple[int, ...]:
    got = m.get(key)
    if got is None or got == []:
        return ()
    if (not isinstance(got, list) or len(got) != n
            or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_LAYERS for x in got)
            or sum(got) > MAX_LAYERS or not any(got)):
        raise ProtocolError(
            f"'pipeline.{key}' must list one layer count per model stage ({n}, 'pipeline.n_stages'), each "
            f"0 to {MAX_LAYERS}, at most {MAX_LAYERS} in all and not all 0, got {_short(got)}.")
    return tuple(got)


def _layer_names(m: Mapping[str, Any], layers: tuple[int, ...]) -> tuple[str, ...]:
    got = m.get("layer_names")
    if got is None or got == []:
        return ()
    if not layers:
        raise ProtocolError("'pipeline.layer_names' comes with 'pipeline.layers_per_stage' only: it names those layers.")
    if (not isinstance(got, list) or len(got) != sum(layers)
            or any(not isinstance(x, str) or not x or len(x) > MAX_NAME_CHARS or "\x00" in x for x in got)):
        raise ProtocolError(
            f"'pipeline.layer_names' must name every layer of 'pipeline.layers_per_stage' ({sum(layers)}) in "
            f"model order, each 1 to {MAX_NAME_CHARS} characters without NUL, got {_short(got)}.")
    return tuple(got)


@dataclass(kw_only=True, slots=True)
class Hello:
    """First frame of every hook connection: who is talking and what it holds."""

    TYPE: ClassVar[str] = "hello"
    job: str
    rank: int
    world_size: int
    global_batch_size: int
    local_rank: int = 0
    host: str = ""
    pid: int = 0
    device_type: str = "cpu"
    device_name: str = ""
    mem_total_bytes: int | None = None
    placement_version: int = 0
    batch_index: int = 0
    restart_count: int = 0
    hook_version: str = ""
    total_steps: int | None = None
    # What the hook reads peak memory with ("cuda", "rocm", "xpu"; "" for nothing: a CPU
    # rank, whose placements then get no memory cap).
    memory_source: str = ""
    # The GPU as NVML names it (dcgm-exporter's ``gpu`` and ``UUID`` labels); None and ""
    # for a CPU rank or a GPU NVML cannot see.
    gpu_index: int | None = None
    gpu_uuid: str = ""
    # The collective the step records' ``comm_bytes`` go through (COMM_KINDS; "" unknown).
    comm_kind: str = ""
    # A device-mesh job (``RebalanceHook(dp_mesh=...)``): its shape; None for plain data parallel.
    mesh: MeshShape | None = None
    # A mesh job: the global ranks of the replica this hook speaks for, leader first
    # (``mesh.replica_size`` of them); empty for plain data parallel.
    replica_ranks: tuple[int, ...] = ()
    # ... and each member's host and device ("node-a NVIDIA H100 80GB HBM3 #4"), in the
    # order of ``replica_ranks``: the job view lists them; empty when unknown.
    replica_devices: tuple[str, ...] = ()
    # The mode the job asks to start in (``RebalanceHook(mode=...)``, one of HELLO_MODES);
    # the backend applies it to a job it has not seen yet (an operator's preset wins). ""
    # for none: the backend's default.
    mode: str = ""
    # Micro-batch placements (``RebalanceHook(micro_batches=M)``, docs/streaming.md): shares
    # and local batch sizes count fixed-shape micro-batches, ``global_batch_size`` is M.
    micro_batches: bool = False
    # A pipelined job (``RebalanceHook(dp_mesh=..., pp_mesh=...)``, docs/pipelines.md): its
    # shape; None otherwise. It implies ``micro_batches``: shares count micro-batches.
    pipeline: PipelineShape | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Hello:
        world = _int(d, "world_size", lo=1, hi=MAX_WORLD_SIZE)
        rank = _int(d, "rank", hi=world - 1)
        batch = _int(d, "global_batch_size", lo=1, hi=MAX_GLOBAL_BATCH_SIZE)
        if batch < world:
            raise ProtocolError(
                f"'global_batch_size' ({batch}) must be at least 'world_size' ({world}): every rank needs a sample.")
        mesh = MeshShape.from_dict(d["mesh"], world_size=world) if d.get("mesh") is not None else None
        pipeline = (PipelineShape.from_dict(d["pipeline"], rank=rank, world_size=world, global_batch_size=batch,
                                            mesh=mesh) if d.get("pipeline") is not None else None)
        micro = _bool(d, "micro_batches", default=pipeline is not None)
        if pipeline is not None and not micro:
            raise ProtocolError(
                "'micro_batches' must be true (or absent) with 'pipeline': a pipeline's share counts micro-batches.")
        return cls(
            job=_job(d),
            rank=rank,
            world_size=world,
            global_batch_size=batch,
            local_rank=_int(d, "local_rank", hi=MAX_WORLD_SIZE - 1, default=0),
            host=_str(d, "host", default=""),
            pid=_int(d, "pid", hi=MAX_COUNT, default=0),
            device_type=_str(d, "device_type", default="cpu"),
            device_name=_str(d, "device_name", default=""),
            mem_total_bytes=_int(d, "mem_total_bytes", hi=MAX_BYTES, default=None),
            placement_version=_int(d, "placement_version", hi=MAX_VERSION, default=0),
            batch_index=_int(d, "batch_index", hi=MAX_BATCH_INDEX, default=0),
            restart_count=_int(d, "restart_count", hi=MAX_COUNT, default=0),
            hook_version=_str(d, "hook_version", default=""),
            total_steps=_int(d, "total_steps", lo=1, hi=MAX_BATCH_INDEX, default=None),
            memory_source=_str(d, "memory_source", max_len=32, default=""),
            gpu_index=_int(d, "gpu_index", hi=MAX_GPU_INDEX, default=None),
            gpu_uuid=_str(d, "gpu_uuid", default=""),
            comm_kind=_comm_kind(d),
            mesh=mesh,
            replica_ranks=(members := _replica_ranks(d, mesh)),
            replica_devices=_replica_devices(d, members),
            mode=_hello_mode(d),
            micro_batches=micro,
            pipeline=pipeline,
        )


# The control modes a hello may ask for (backend.control.modes.MODES names the same three).
HELLO_MODES = ("observe", "approve", "auto")


def _hello_mode(d: Mapping[str, Any]) -> str:
    mode = _str(d, "mode", max_len=16, default="")
    if mode and mode not in HELLO_MODES:
        raise ProtocolError(f"'mode' must be one of {', '.join(HELLO_MODES)} (or absent), got {mode!r}.")
    return mode


@dataclass(kw_only=True, slots=True)
class StepRecord:
    """One step of one rank. Times in milliseconds; ``t`` is the Unix time at step end.

    ``compute_ms`` is the time until this rank's gradients were ready, excluding the wait
    inside gradient synchronisation (``sync_wait_ms``); see docs/design.md invariant 4.

    ``mem_peak_bytes`` (version 2, on some records only): the peak device memory the
    allocator handed out over the steps since the previous reading, all at this record's
    local batch size; ``mem_reserved_bytes`` what the caching allocator holds and
    ``mem_total_bytes`` the device's memory at that moment. Absent where not read.

    ``work`` and ``batch_work`` (only with a per-sample cost, ``sample_cost=``): this
    rank's summed cost in the step and the whole global batch's, so that speed is learned
    in work per second. Absent without a cost (every sample costs 1).
    ``work_sq`` and ``batch_work_sq`` (only with sample lengths, ``sample_length=``): the
    sums of the squared lengths of this rank's samples and of the global batch's (``work``
    is then the summed lengths), from which the backend fits ``time = c + a*sum(L) +
    b*sum(L^2)`` per rank. Absent otherwise; old hooks never send them.
    ``comm_bytes`` (version 2, optional): bytes this rank handed to gradient collectives
    in the step (DDP: its bucket buffers; FSDP: its reduce-scatter inputs); ``comm_ms``
    the time one of them was in flight, overlapped with compute or not (the exposed part
    is in ``sync_wait_ms``). Absent where not measured, never 0 for unknown.
    ``slowest_rank`` (a mesh replica's leader only): the global rank of the member whose
    compute time the record's ``compute_ms`` is (docs/meshes.md). Absent otherwise.

    The step broken down further (docs/causes.md; optional, older hooks never send them):
    ``host_ms`` and ``ckpt_ms`` are parts of ``data_wait_ms`` (the gap before the step):
    host work outside the hook's loader and checkpoint writes (``hook.checkpointing()``);
    the rest of the gap is the loader's. ``host_ms`` only comes with ``hook.data_loader()``
    (without it the hook cannot tell the loader from the rest). ``gc_ms`` is the Python
    garbage collector's pauses per generation ``[gen0, gen1, gen2]`` anywhere in the step
    (its gap included), absent when all three are 0. Their sums are checked at the edge:
    ``host_ms + ckpt_ms <= data_wait_ms``, ``sum(gc_ms) <= step_ms``.
    """

    batch_index: int
    local_batch_size: int
    placement_version: int
    data_wait_ms: float
    compute_ms: float
    sync_wait_ms: float
    optimizer_ms: float
    step_ms: float
    t: float
    mem_peak_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    mem_total_bytes: int | None = None
    work: float | None = None
    batch_work: float | None = None
    comm_bytes: int | None = None
    comm_ms: float | None = None
    work_sq: float | None = None
    batch_work_sq: float | None = None
    slowest_rank: int | None = None
    host_ms: float | None = None
    ckpt_ms: float | None = None
    gc_ms: tuple[float, float, float] | None = None
    # A pipeline's leader (hello.pipeline; docs/pipelines.md): the micro-batches the schedule
    # ran, the pipeline's bubble (the mean of its stages'), and per pipeline rank, in stage
    # order, the mean forward and backward ms of one micro-batch (its model stages summed),
    # the step's waits in sends and receives and its idle time. ``layer_ms``: per layer in
    # model order (hello.pipeline.layers_per_stage), forward + backward ms of one micro-batch.
    n_microbatches: int | None = None
    bubble_ms: float | None = None
    stage_fwd_ms: tuple[float, ...] | None = None
    stage_bwd_ms: tuple[float, ...] | None = None
    stage_send_wait_ms: tuple[float, ...] | None = None
    stage_recv_wait_ms: tuple[float, ...] | None = None
    stage_bubble_ms: tuple[float, ...] | None = None
    layer_ms: tuple[float, ...] | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepRecord:
        # Fast path: step records are most of what the backend parses (thousands a second),
        # so check the common, valid shape in one pass; anything off takes the slow path,
        # which names the field that is wrong. Records with memory fields take it too.
        n_fields = len(d) if type(d) is dict else 0
        if n_fields > 9 and _phase_count(d):  # the step's phases: checked apart (slow path)
            rec = cls.from_dict({k: v for k, v in d.items() if k not in _PHASE_KEYS})
            _set_phases(rec, d)
            return rec
        if n_fields > 9 and _pipeline_count(d):  # a pipeline's leader: its stages checked apart
            rec = cls.from_dict({k: v for k, v in d.items() if k not in _PIPELINE_KEYS})
            _set_pipeline(rec, d)
            return rec
        if n_fields == 9 or (n_fields == 11 and "comm_ms" in d):
            try:
                bi, lb, pv = d["batch_index"], d["local_batch_size"], d["placement_version"]
                dw, cm, sw = d["data_wait_ms"], d["compute_ms"], d["sync_wait_ms"]
                om, sm, t = d["optimizer_ms"], d["step_ms"], d["t"]
            except KeyError:
                pass
            else:
                num, ms = _NUMBER_TYPES, MAX_DURATION_MS
                if (
                    type(bi) is int and type(lb) is int and type(pv) is int
                    and 0 <= bi <= MAX_BATCH_INDEX and 0 <= lb <= MAX_GLOBAL_BATCH_SIZE
                    and 0 <= pv <= MAX_VERSION
                    and type(dw) in num and type(cm) in num and type(sw) in num
                    and type(om) in num and type(sm) in num and type(t) in num
                    and 0 <= dw <= ms and 0 <= cm <= ms and 0 <= sw <= ms
                    and 0 <= om <= ms and 0 <= sm <= ms and 0 <= t <= _MAX_UNIX_TIME
                ):
                    if n_fields == 9:
                        return cls(
                            batch_index=bi, local_batch_size=lb, placement_version=pv,
                            data_wait_ms=float(dw), compute_ms=float(cm), sync_wait_ms=float(sw),
                            optimizer_ms=float(om), step_ms=float(sm), t=float(t),
                        )
                    cb, cms = d.get("comm_bytes"), d["comm_ms"]
                    if type(cb) is int and 0 < cb <= MAX_BYTES and type(cms) in num and 0 <= cms <= ms:
                        return cls(
                            batch_index=bi, local_batch_size=lb, placement_version=pv,
                            data_wait_ms=float(dw), compute_ms=float(cm), sync_wait_ms=float(sw),
                            optimizer_ms=float(om), step_ms=float(sm), t=float(t),
                            comm_bytes=cb, comm_ms=float(cms),
                        )
        return cls(
            batch_index=_int(d, "batch_index", hi=MAX_BATCH_INDEX),
            local_batch_size=_int(d, "local_batch_size", hi=MAX_GLOBAL_BATCH_SIZE),
            placement_version=_int(d, "placement_version", hi=MAX_VERSION),
            data_wait_ms=_float(d, "data_wait_ms", hi=MAX_DURATION_MS),
            compute_ms=_float(d, "compute_ms", hi=MAX_DURATION_MS),
            sync_wait_ms=_float(d, "sync_wait_ms", hi=MAX_DURATION_MS),
            optimizer_ms=_float(d, "optimizer_ms", hi=MAX_DURATION_MS),
            step_ms=_float(d, "step_ms", hi=MAX_DURATION_MS),
            t=_float(d, "t", hi=_MAX_UNIX_TIME),
            mem_peak_bytes=_int(d, "mem_peak_bytes", hi=MAX_BYTES, default=None),
            mem_reserved_bytes=_int(d, "mem_reserved_bytes", hi=MAX_BYTES, default=None),
            mem_total_bytes=_int(d, "mem_total_bytes", hi=MAX_BYTES, default=None),
            work=_float(d, "work", hi=MAX_WORK, default=None),
            batch_work=_float(d, "batch_work", hi=MAX_WORK, default=None),
            work_sq=_float(d, "work_sq", hi=MAX_WORK_SQ, default=None),
            batch_work_sq=_float(d, "batch_work_sq", hi=MAX_WORK_SQ, default=None),
            comm_bytes=_int(d, "comm_bytes", lo=1, hi=MAX_BYTES, default=None),
            comm_ms=_float(d, "comm_ms", hi=MAX_DURATION_MS, default=None),
            slowest_rank=_int(d, "slowest_rank", hi=MAX_WORLD_SIZE - 1, default=None),
        )

    def to_dict(self) -> dict[str, Any]:
        """The record as sent: memory and communication fields only where read."""
        d = {f: getattr(self, f) for f in STEP_FIELDS}
        if self.comm_bytes is not None:
            d["comm_bytes"] = self.comm_bytes
            if self.comm_ms is not None:
                d["comm_ms"] = self.comm_ms
        if self.mem_peak_bytes is not None:
            d["mem_peak_bytes"] = self.mem_peak_bytes
            if self.mem_reserved_bytes is not None:
                d["mem_reserved_bytes"] = self.mem_reserved_bytes
            if self.mem_total_bytes is not None:
                d["mem_total_bytes"] = self.mem_total_bytes
        if self.work is not None:
            d["work"] = self.work
            d["batch_work"] = self.batch_work
            if self.work_sq is not None:
                d["work_sq"] = self.work_sq
                d["batch_work_sq"] = self.batch_work_sq
        if self.slowest_rank is not None:
            d["slowest_rank"] = self.slowest_rank
        if self.host_ms is not None:
            d["host_ms"] = self.host_ms
        if self.ckpt_ms:
            d["ckpt_ms"] = self.ckpt_ms
        if self.gc_ms is not None:
            d["gc_ms"] = list(self.gc_ms)
        if self.n_microbatches is not None:
            d["n_microbatches"] = self.n_microbatches
        if self.bubble_ms is not None:
            d["bubble_ms"] = self.bubble_ms
        for key in PIPELINE_STAGE_FIELDS:
            val = getattr(self, key)
            if val is not None:
                d[key] = list(val)
        if self.layer_ms is not None:
            d["layer_ms"] = list(self.layer_ms)
        return d


# The step's optional phases (StepRecord docstring, docs/causes.md). A sum may exceed its
# whole by this much (float rounding of the hook's own arithmetic), no more.
_PHASE_KEYS = frozenset(("host_ms", "ckpt_ms", "gc_ms"))
_PHASE_SLACK_MS = 0.01


def _phase_count(d: Mapping[str, Any]) -> int:
    return sum(1 for k in _PHASE_KEYS if k in d)


def _set_phases(rec: StepRecord, d: Mapping[str, Any]) -> None:
    """Read and check the record's phases: each in range, and the parts within their whole."""
    rec.host_ms = _float(d, "host_ms", hi=MAX_DURATION_MS, default=None)
    rec.ckpt_ms = _float(d, "ckpt_ms", hi=MAX_DURATION_MS, default=None)
    gc_ms = d.get("gc_ms")
    if gc_ms is not None:
        if (not isinstance(gc_ms, list) or len(gc_ms) != 3
                or any(type(x) not in _NUMBER_TYPES or not (0.0 <= x <= MAX_DURATION_MS) for x in gc_ms)):
            raise ProtocolError(
                f"'gc_ms' must be a list of 3 numbers (ms of garbage collection in generations 0, 1 "
                f"and 2), each between 0 and {_num(MAX_DURATION_MS)}, got {_short(gc_ms)}.")
        rec.gc_ms = (float(gc_ms[0]), float(gc_ms[1]), float(gc_ms[2]))
    parts = (rec.host_ms or 0.0) + (rec.ckpt_ms or 0.0)
    if parts > rec.data_wait_ms * (1 + 1e-9) + _PHASE_SLACK_MS:
        raise ProtocolError(
            f"'host_ms' + 'ckpt_ms' ({parts:g}) must not exceed 'data_wait_ms' ({rec.data_wait_ms:g}): "
            f"they are parts of the wait before the step.")
    if rec.gc_ms is not None and sum(rec.gc_ms) > rec.step_ms * (1 + 1e-9) + _PHASE_SLACK_MS:
        raise ProtocolError(
            f"'gc_ms' sums to {sum(rec.gc_ms):g} ms, more than the step's 'step_ms' ({rec.step_ms:g}): "
            f"the pauses are parts of the step.")


# A pipeline leader's per-stage lists (StepRecord), one number per pipeline rank each.
PIPELINE_STAGE_FIELDS = ("stage_fwd_ms", "stage_bwd_ms", "stage_send_wait_ms", "stage_recv_wait_ms",
                         "stage_bubble_ms")
_PIPELINE_KEYS = frozenset(("n_microbatches", "bubble_ms", "layer_ms", *PIPELINE_STAGE_FIELDS))


def _pipeline_count(d: Mapping[str, Any]) -> int:
    return sum(1 for k in _PIPELINE_KEYS if k in d)


def _ms_list(d: Mapping[str, Any], key: str, *, max_len: int) -> tuple[float, ...] | None:
    got = d.get(key)
    if got is None:
        return None
    if (not isinstance(got, list) or not 1 <= len(got) <= max_len
            or any(type(x) not in _NUMBER_TYPES or not (0.0 <= x <= MAX_DURATION_MS) for x in got)):
        raise ProtocolError(
            f"'{key}' must be a list of 1 to {max_len} numbers (ms), each between 0 and "
            f"{_num(MAX_DURATION_MS)}, got {_short(got)}.")
    return tuple(float(x) for x in got)


def _set_pipeline(rec: StepRecord, d: Mapping[str, Any]) -> None:
    """Read and check a pipeline leader's fields: each in range, the stage lists one length."""
    rec.n_microbatches = _int(d, "n_microbatches", hi=MAX_GLOBAL_BATCH_SIZE, default=None)
    rec.bubble_ms = _float(d, "bubble_ms", hi=MAX_DURATION_MS, default=None)
    lengths = {}
    for key in PIPELINE_STAGE_FIELDS:
        val = _ms_list(d, key, max_len=MAX_PP_STAGES)
        setattr(rec, key, val)
        if val is not None:
            lengths[key] = len(val)
    if len(set(lengths.values())) > 1:
        raise ProtocolError(
            f"The stage lists must have one entry per pipeline rank each, but their lengths differ: "
            f"{', '.join(f'{k} {n}' for k, n in lengths.items())}.")
    if (rec.stage_fwd_ms is None) != (rec.stage_bwd_ms is None):
        raise ProtocolError("'stage_fwd_ms' and 'stage_bwd_ms' come together: a stage's time per micro-batch is both.")
    rec.layer_ms = _ms_list(d, "layer_ms", max_len=MAX_LAYERS)
    if rec.bubble_ms is not None and rec.bubble_ms > rec.step_ms * (1 + 1e-9) + _PHASE_SLACK_MS:
        raise ProtocolError(
            f"'bubble_ms' ({rec.bubble_ms:g}) must not exceed the step's 'step_ms' ({rec.step_ms:g}): the "
            f"bubble is part of the step.")


# DeviceSample's link rates (bytes per second), in order.
LINK_FIELDS = ("nic_tx_bytes_per_s", "nic_rx_bytes_per_s", "ib_tx_bytes_per_s", "ib_rx_bytes_per_s",
               "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s", "nvlink_tx_bytes_per_s", "nvlink_rx_bytes_per_s")
MAX_LINK_BYTES_PER_S = 1e13  # 10 TB/s: above any link of one node today

# The gradient collectives a hook reports bytes for (Hello.comm_kind); "" for unknown.
COMM_KINDS = ("all_reduce", "reduce_scatter")


def _comm_kind(d: Mapping[str, Any]) -> str:
    kind = _str(d, "comm_kind", max_len=32, default="")
    if kind not in ("", *COMM_KINDS):
        raise ProtocolError(f"'comm_kind' must be one of {', '.join(COMM_KINDS)} or empty, got {kind!r}.")
    return str(kind)


# The record's one definition of its shape: the fields every step record carries, in the
# order of the backend's row layout (backend.live.rows), and the ones that say where the
# step's time went. Live state, storage, the REST models, the client, the dashboard feed
# and the report carry the same names (tests/test_record_shape.py holds them to it).
STEP_FIELDS = ("batch_index", "local_batch_size", "placement_version", "data_wait_ms",
               "compute_ms", "sync_wait_ms", "optimizer_ms", "step_ms", "t")
STEP_TIMES = ("compute_ms", "sync_wait_ms", "data_wait_ms", "optimizer_ms", "step_ms")
_NUMBER_TYPES = frozenset((int, float))


@dataclass(kw_only=True, slots=True)
class DeviceSample:
    """One device reading (about 1 Hz). Fields the source cannot read are None."""

    t: float
    source: str  # "nvml" or "psutil"
    util_pct: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    power_w: float | None = None
    temp_c: float | None = None
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    throttle_reasons: list[str] = field(default_factory=list)
    cpu_pct: float | None = None
    rss_bytes: int | None = None
    # Link throughput of the node, bytes per second each way (trainer_hook.links): host
    # NICs, InfiniBand ports, this GPU's PCIe and NVLink. None where there is no counter.
    nic_tx_bytes_per_s: float | None = None
    nic_rx_bytes_per_s: float | None = None
    ib_tx_bytes_per_s: float | None = None
    ib_rx_bytes_per_s: float | None = None
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    nvlink_tx_bytes_per_s: float | None = None
    nvlink_rx_bytes_per_s: float | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceSample:
        source = _str(d, "source")
        if source not in ("nvml", "psutil"):
            raise ProtocolError(f"'source' must be 'nvml' or 'psutil', got {source!r}.")
        reasons = _list(d, "throttle_reasons", max_len=32, default=[])
        for r in reasons:
            if not isinstance(r, str) or len(r) > 64 or "\x00" in r:
                raise ProtocolError("'throttle_reasons' must be a list of short strings.")
        return cls(
            t=_float(d, "t", hi=_MAX_UNIX_TIME),
            source=source,
            util_pct=_float(d, "util_pct", hi=_MAX_PCT, default=None),
            mem_used_bytes=_int(d, "mem_used_bytes", hi=MAX_BYTES, default=None),
            mem_total_bytes=_int(d, "mem_total_bytes", hi=MAX_BYTES, default=None),
            power_w=_float(d, "power_w", hi=_MAX_POWER_W, default=None),
            temp_c=_float(d, "temp_c", lo=-273.0, hi=_MAX_TEMP_C, default=None),
            sm_clock_mhz=_float(d, "sm_clock_mhz", hi=_MAX_CLOCK_MHZ, default=None),
            sm_clock_max_mhz=_float(d, "sm_clock_max_mhz", hi=_MAX_CLOCK_MHZ, default=None),
            throttle_reasons=list(reasons),
            cpu_pct=_float(d, "cpu_pct", hi=_MAX_CPU_PCT, default=None),
            rss_bytes=_int(d, "rss_bytes", hi=MAX_BYTES, default=None),
            **{f: _float(d, f, hi=MAX_LINK_BYTES_PER_S, default=None) for f in LINK_FIELDS},
        )


HANG_PHASES = ("data_wait", "compute", "sync_wait", "optimizer")  # where a stalled rank is
MAX_STACK_CHARS = 16384  # a hang report's stack: its innermost frames, cut to this
MAX_PATH_CHARS = 4096  # a file path in a report (Linux's PATH_MAX)


@dataclass(kw_only=True, slots=True)
class Hang:
    """A rank that stopped stepping (``metrics.hang``, version 2, additive; docs/causes.md).

    Its hook's watchdog saw no step end for ``stalled_s`` seconds: the rank is in ``phase``
    (HANG_PHASES: before the step, computing, inside the gradient collective, in the
    optimizer) of batch ``batch_index`` since Unix time ``since``, and ``stack`` is its
    training thread's Python stack (innermost last, at most MAX_STACK_CHARS). On CUDA,
    ``nccl_dump`` is where PyTorch's NCCL flight recorder writes its dump of this rank when
    the collective times out (at most MAX_PATH_CHARS; absent where no dump is made)."""

    batch_index: int
    phase: str
    since: float
    stalled_s: float
    stack: str = ""
    nccl_dump: str | None = None

    @classmethod
    def from_dict(cls, d: Any) -> Hang:
        h = _obj(d, "'hang'")
        phase = _str(h, "phase", max_len=32)
        if phase not in HANG_PHASES:
            raise ProtocolError(f"'hang.phase' must be one of {', '.join(HANG_PHASES)}, got {phase!r}.")
        return cls(batch_index=_int(h, "batch_index", hi=MAX_BATCH_INDEX), phase=phase,
                   since=_float(h, "since", hi=_MAX_UNIX_TIME), stalled_s=_float(h, "stalled_s", hi=MAX_DURATION_MS / 1e3),
                   stack=_str(h, "stack", max_len=MAX_STACK_CHARS, default=""),
                   nccl_dump=_str(h, "nccl_dump", max_len=MAX_PATH_CHARS, default=None, nonempty=True))


@dataclass(kw_only=True, slots=True)
class Metrics:
    """A batch of step records and device samples from one rank.

    ``dropped`` counts records the hook could not buffer since its last successful send.
    ``total_steps`` (optional) is how many steps the run will take in all, when the
    training loop knows it; the backend turns it into the job's ETA.
    """

    TYPE: ClassVar[str] = "metrics"
    job: str
    rank: int
    steps: list[StepRecord] = field(default_factory=list)
    device: list[DeviceSample] = field(default_factory=list)
    dropped: int = 0
    total_steps: int | None = None
    # The hook flushed this frame early: a step's time per sample deviated strongly from
    # the rank's recent median (a slowdown). The backend runs the policy on it at once.
    urgent: bool = False
    # The rank stopped stepping (its hook's watchdog; docs/causes.md); absent otherwise.
    hang: Hang | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Metrics:
        steps = [StepRecord.from_dict(_obj(s, "each step")) for s in _list(d, "steps", default=[])]
        device = [DeviceSample.from_dict(_obj(s, "each device sample")) for s in _list(d, "device", default=[])]
        return cls(
            job=_job(d),
            rank=_int(d, "rank", hi=MAX_WORLD_SIZE - 1),
            steps=steps,
            device=device,
            dropped=_int(d, "dropped", hi=MAX_COUNT, default=0),
            total_steps=_int(d, "total_steps", lo=1, hi=MAX_BATCH_INDEX, default=None),
            urgent=_bool(d, "urgent", default=False),
            hang=Hang.from_dict(d["hang"]) if d.get("hang") is not None else None,
        )

    def check_against(self, hello: Hello, now: float, last_batch_index: int | None = None) -> None:
        """The ranges that need the sender's ``hello`` and the receiver's clock: no step
        larger than the job's global batch, every ``t`` within ``MAX_AGE_S`` before and
        ``MAX_AHEAD_S`` after ``now``, every ``batch_index`` within ``MAX_BATCH_JUMP`` of the
        rank's last (``last_batch_index``, by default the hello's). Raises ProtocolError
        naming the first record off."""
        lo, hi, cap = now - MAX_AGE_S, now + MAX_AHEAD_S, hello.global_batch_size
        last = hello.batch_index if last_batch_index is None else last_batch_index
        for i, s in enumerate(self.steps):
            if abs(s.batch_index - last) > MAX_BATCH_JUMP:
                raise ProtocolError(
                    f"'steps[{i}].batch_index' is {s.batch_index}, {s.batch_index - last:+d} from this rank's "
                    f"last ({last}); it must be within {MAX_BATCH_JUMP} of it (MAX_BATCH_JUMP). A run resumed "
                    f"elsewhere says its batch index in a new hello.")
            if s.local_batch_size > cap:
                raise ProtocolError(
                    f"'steps[{i}].local_batch_size' is {s.local_batch_size} but the job's global batch is {cap}.")
            if not lo <= s.t <= hi:
                raise ProtocolError(_clock_message(f"steps[{i}].t", s.t, now))
            if s.slowest_rank is not None and s.slowest_rank not in hello.replica_ranks:
                raise ProtocolError(
                    f"'steps[{i}].slowest_rank' is {s.slowest_rank}, not a member of this replica "
                    f"(its hello's 'replica_ranks' {list(hello.replica_ranks)}).")
            _check_stages(i, s, hello.pipeline)
        for i, d in enumerate(self.device):
            if not lo <= d.t <= hi:
                raise ProtocolError(_clock_message(f"device[{i}].t", d.t, now))
        if self.hang is not None and not lo <= self.hang.since <= hi:
            raise ProtocolError(_clock_message("hang.since", self.hang.since, now))


def _check_stages(i: int, s: StepRecord, pipe: PipelineShape | None) -> None:
    """A pipeline leader's stage lists against its hello's shape (docs/protocol.md)."""
    if pipe is None and any(getattr(s, k) is not None for k in _PIPELINE_KEYS):
        raise ProtocolError(
            f"'steps[{i}]' carries pipeline stage times, but this hook's hello said no 'pipeline': say the "
            f"pipeline's shape in the hello first.")
    if pipe is None:
        return
    for key in PIPELINE_STAGE_FIELDS:
        val = getattr(s, key)
        if val is not None and len(val) != pipe.pp_size:
            raise ProtocolError(
                f"'steps[{i}].{key}' has {len(val)} entries; this pipeline has {pipe.pp_size} stages "
                f"('pipeline.pp_size'): give one per pipeline rank, in stage order.")
    if s.layer_ms is not None and len(s.layer_ms) != sum(pipe.layers_per_stage):
        raise ProtocolError(
            f"'steps[{i}].layer_ms' has {len(s.layer_ms)} entries, but the hello's 'pipeline.layers_per_stage' "
            f"counts {sum(pipe.layers_per_stage)} layers: give one per layer, in model order.")


def _clock_message(key: str, t: float, now: float) -> str:
    return (f"'{key}' is {t - now:+.0f} s from the backend's clock; it must be within "
            f"{MAX_AGE_S / 86400:g} days before and {MAX_AHEAD_S / 3600:g} hour after it (check the node's clock).")


@dataclass(kw_only=True, slots=True)
class Ack:
    """A rank applied placement ``version`` starting at global batch ``batch_index``."""

    TYPE: ClassVar[str] = "ack"
    job: str
    rank: int
    version: int
    batch_index: int

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Ack:
        return cls(
            job=_job(d),
            rank=_int(d, "rank", hi=MAX_WORLD_SIZE - 1),
            version=_int(d, "version", hi=MAX_VERSION),
            batch_index=_int(d, "batch_index", hi=MAX_BATCH_INDEX),
        )


@dataclass(kw_only=True, slots=True)
class Reject:
    """A rank refused placement ``version``; ``reason`` says why. Training goes on."""

    TYPE: ClassVar[str] = "reject"
    job: str
    rank: int
    version: int
    reason: str

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Reject:
        return cls(
            job=_job(d),
            rank=_int(d, "rank", hi=MAX_WORLD_SIZE - 1),
            version=_int(d, "version", hi=MAX_VERSION),
            reason=_str(d, "reason", max_len=_MAX_TEXT),
        )


@dataclass(kw_only=True, slots=True)
class Oom:
    """A rank ran out of device memory inside ``hook.step()`` (version 2).

    Sent, and flushed, before the exception reaches the training loop: the job is about
    to die. ``version`` is the placement in force, ``local_batch_size`` the failing share.
    """

    TYPE: ClassVar[str] = "oom"
    job: str
    rank: int
    version: int
    batch_index: int
    local_batch_size: int
    mem_peak_bytes: int | None = None
    mem_total_bytes: int | None = None
    message: str = ""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Oom:
        return cls(
            job=_job(d),
            rank=_int(d, "rank", hi=MAX_WORLD_SIZE - 1),
            version=_int(d, "version", hi=MAX_VERSION),
            batch_index=_int(d, "batch_index", hi=MAX_BATCH_INDEX),
            local_batch_size=_int(d, "local_batch_size", lo=1, hi=MAX_GLOBAL_BATCH_SIZE),
            mem_peak_bytes=_int(d, "mem_peak_bytes", hi=MAX_BYTES, default=None),
            mem_total_bytes=_int(d, "mem_total_bytes", hi=MAX_BYTES, default=None),
            message=_str(d, "message", max_len=_MAX_TEXT, default=""),
        )


@dataclass(kw_only=True, slots=True)
class Leave:
    """A rank of a node connection stopped speaking through it (version 2, additive).

    ``code`` is the close code the rank's own websocket would have ended with: 1000 its
    goodbye (``close()``), 1001 it moved to its own connection, anything else it was lost.
    """

    TYPE: ClassVar[str] = "leave"
    job: str
    rank: int
    code: int

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Leave:
        return cls(job=_job(d), rank=_int(d, "rank", hi=MAX_WORLD_SIZE - 1),
                   code=_int(d, "code", lo=1000, hi=4999))


@dataclass(kw_only=True, slots=True)
class Placement:
    """The backend asks the job to run with ``shares`` from now on (rank 0 picks when).

    Sent in reply to every ``hello`` (the placement in force) and whenever a proposal is
    approved, auto-applied, overridden or rolled back.

    ``length_sq_weight`` (k >= 0, optional, 0 when absent): the cost model the job's split
    uses for samples given by length (``sample_length=``): a sample of length L costs
    ``L + k*L^2``. The backend fits it from the step times (``a*sum(L) + b*sum(L^2)``, k =
    b/a); it takes effect with the placement, at the batch index rank 0 picks for it.

    ``epoch`` (optional, 0 when absent): the lease epoch of the backend replica that sent it
    (a fence: it rises with every take-over of the job); rank 0 refuses a placement whose
    epoch is below one it has seen, since its sender no longer owns the job.
    """

    TYPE: ClassVar[str] = "placement"
    job: str
    version: int
    shares: list[int]
    global_batch_size: int
    proposal_id: int | None = None
    reason: str = ""
    length_sq_weight: float = 0.0
    epoch: int = 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Placement:
        shares = _list(d, "shares", max_len=MAX_WORLD_SIZE)
        for i, s in enumerate(shares):
            if isinstance(s, bool) or not isinstance(s, int):
                raise ProtocolError(f"'shares[{i}]' must be an integer, got {_short(s)}.")
            if not 0 <= s <= MAX_GLOBAL_BATCH_SIZE:
                raise ProtocolError(f"'shares[{i}]' must be between 0 and {MAX_GLOBAL_BATCH_SIZE}, got {_short(s)}.")
        return cls(
            job=_job(d),
            version=_int(d, "version", hi=MAX_VERSION),
            shares=list(shares),
            global_batch_size=_int(d, "global_batch_size", lo=1, hi=MAX_GLOBAL_BATCH_SIZE),
            proposal_id=_int(d, "proposal_id", hi=MAX_VERSION, default=None),
            reason=_str(d, "reason", max_len=_MAX_TEXT, default=""),
            length_sq_weight=_float(d, "length_sq_weight", hi=MAX_LENGTH_SQ_WEIGHT, default=0.0),
            epoch=_int(d, "epoch", hi=MAX_VERSION, default=0),
        )


@dataclass(kw_only=True, slots=True)
class Error:
    """The backend refused a frame; it usually closes the connection right after."""

    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    rank: int | None = None  # on a node connection: the one rank refused (the others go on)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Error:
        return cls(code=_str(d, "code"), message=_str(d, "message", max_len=_MAX_TEXT),
                   rank=_int(d, "rank", hi=MAX_WORLD_SIZE - 1, default=None))


Message: TypeAlias = Hello | Metrics | Ack | Reject | Oom | Leave | Placement | Error
_TYPES: dict[str, Any] = {c.TYPE: c for c in (Hello, Metrics, Ack, Reject, Oom, Leave, Placement, Error)}
_V2_ONLY = {"memory_source", "gpu_index", "gpu_uuid", "mesh", "replica_ranks", "replica_devices", "micro_batches", "pipeline"}  # hello fields a version-1 peer does not know


def encode(msg: Message, version: int = PROTOCOL_VERSION) -> str:
    """Serialise a message to one compact JSON text frame of protocol ``version``."""
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"version must be one of {SUPPORTED_VERSIONS}, got {version!r}.")
    body = {f.name: getattr(msg, f.name) for f in fields(msg)}
    if body.get("total_steps", 0) is None:
        del body["total_steps"]  # optional and rarely set: absent rather than null
    if isinstance(msg, Error) and body["rank"] is None:
        del body["rank"]  # likewise
    if body.get("urgent", True) is False:
        del body["urgent"]  # likewise
    if "hang" in body:
        if body["hang"] is None:
            del body["hang"]  # likewise
        else:
            body["hang"] = asdict(body["hang"])
            if body["hang"]["nccl_dump"] is None:
                del body["hang"]["nccl_dump"]  # likewise: no flight recorder dump
    if body.get("comm_kind", None) == "":
        del body["comm_kind"]  # likewise
    if body.get("micro_batches", True) is False:
        del body["micro_batches"]  # likewise
    if isinstance(msg, Hello) and body["mode"] == "":
        del body["mode"]  # likewise: the backend's default
    if "pipeline" in body:
        if body["pipeline"] is None:
            del body["pipeline"]  # absent for a job without pipeline parallelism
        else:
            body["pipeline"] = body["pipeline"].to_dict()
    if "mesh" in body:
        if body["mesh"] is None:
            del body["mesh"]  # absent for plain data parallel
        else:
            body["mesh"] = body["mesh"].to_dict()  # in place: the fields keep their order
    if body.get("replica_ranks", None) == ():
        del body["replica_ranks"]  # likewise
    elif "replica_ranks" in body:
        body["replica_ranks"] = list(body["replica_ranks"])
    if body.get("replica_devices", None) == ():
        del body["replica_devices"]  # likewise
    elif "replica_devices" in body:
        body["replica_devices"] = list(body["replica_devices"])
    if body.get("length_sq_weight", None) == 0.0:
        del body["length_sq_weight"]  # likewise: a hook without it reads the same
    if isinstance(msg, Placement) and body.get("epoch", None) == 0:
        del body["epoch"]  # likewise: a backend without replicas' leases
    if version < 2:
        for key in _V2_ONLY:
            body.pop(key, None)
    if isinstance(msg, Metrics):
        body["steps"] = [s.to_dict() for s in msg.steps]
        body["device"] = [_device_dict(s) for s in msg.device]
    return json.dumps({"type": msg.TYPE, "v": version, **body}, separators=(",", ":"))


def _device_dict(s: DeviceSample) -> dict[str, Any]:
    """A device sample as sent: link rates only where the node has the counter."""
    d = asdict(s)
    for f in LINK_FIELDS:
        if d[f] is None:
            del d[f]
    return d


def decode(raw: str | bytes) -> Message:
    """Parse and validate one frame; raise ProtocolError saying what is wrong."""
    return decode_versioned(raw)[0]


def decode_versioned(raw: str | bytes) -> tuple[Message, int]:
    """``decode``, and the protocol version the frame spoke."""
    _check_size(raw)
    if _fast_loads is not None:
        # orjson (the backend's extra) on the way frames usually go. Anything that fails on
        # it (NaN, nesting deeper than 1,024, a bad field: integers beyond 64 bits reach the
        # checks as floats there) is decoded again below, so a frame is accepted, and an
        # error worded, exactly as by the standard library alone (a hook-only install).
        try:
            return _decode_object(_fast_loads(raw))
        except ValueError:  # orjson's JSONDecodeError and ProtocolError are ValueErrors
            pass
    return _decode_object(_std_loads(raw))


def parse(raw: str | bytes) -> Any:
    """The frame's JSON, size-checked (``ProtocolError`` when too big or not JSON); not yet
    validated. Node frames (``rebalancer_wire.node``) are read from it."""
    _check_size(raw)
    if _fast_loads is not None:
        try:
            return _fast_loads(raw)
        except ValueError:  # worded by the standard library's parser below
            pass
    return _std_loads(raw)


def _check_size(raw: str | bytes) -> None:
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            f"Message of {len(raw)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit; send smaller batches.",
            code="too_big",
            close_code=CLOSE_TOO_BIG,
        )


def _std_loads(raw: str | bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"Message is not valid JSON: {exc}.") from None
    except RecursionError:  # JSON nested thousands deep
        raise ProtocolError("Message is nested too deeply; messages are flat JSON objects.") from None


def _decode_object(obj: Any) -> tuple[Message, int]:
    obj = _obj(obj, "A message")
    version = obj.get("v")
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            f"Protocol version {version!r} is not supported; this side speaks versions "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}.",
            code="unsupported_version",
            close_code=CLOSE_UNSUPPORTED_VERSION,
        )
    kind = obj.get("type")
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"Unknown message type {kind!r}; expected one of {sorted(_TYPES)}.")
    return cls.from_dict(obj), version

"""Node frames (protocol version 3): one node's ranks' step records and device samples in one
frame, packed by column (docs/protocol.md, ``node_metrics``).

A node agent (trainer_hook/node_agg.py) carries up to 256 ranks on one connection. Sent one
``metrics`` frame per rank, every rank's records pay their own JSON keys, envelope and
websocket frame, and the backend its own decode and fold. Here one header names the job and
the ranks; each field is one array over every record of the frame (``steps.compute_ms``:
rank a's records, then rank b's ...), ``n_steps[i]`` and ``n_device[i]`` say how many of
them are ``ranks[i]``'s. Every number is checked against the same ranges as in a per-rank
frame (``rebalancer_wire.protocol``), column by column; a column of the wrong length, a rank
named twice, a value off its range refuse the whole frame (``ProtocolError``, 4002); the
checks that need a rank's hello (``NodeMetrics.check_against``) refuse that rank alone.

Per-rank frames stay: a single rank's hook and hooks of older versions send them, and
``decode_frame`` reads both kinds (the backend's ingest uses it). Standard library only.

One module, over 400 lines on purpose: the node frame's columns, their checks, packing and
unpacking in one place, so that both ends read it with the same code."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rebalancer_wire.protocol import (
    _MAX_CLOCK_MHZ,
    _MAX_CPU_PCT,
    _MAX_PCT,
    _MAX_POWER_W,
    _MAX_TEMP_C,
    _MAX_UNIX_TIME,
    _NUMBER_TYPES,
    _PHASE_SLACK_MS,
    _PIPELINE_KEYS,
    LINK_FIELDS,
    MAX_AGE_S,
    MAX_AHEAD_S,
    MAX_BATCH_INDEX,
    MAX_BATCH_JUMP,
    MAX_BYTES,
    MAX_COUNT,
    MAX_DURATION_MS,
    MAX_GLOBAL_BATCH_SIZE,
    MAX_LINK_BYTES_PER_S,
    MAX_RANKS_PER_CONNECTION,
    MAX_RECORDS_PER_MESSAGE,
    MAX_VERSION,
    MAX_WORK,
    MAX_WORK_SQ,
    MAX_WORLD_SIZE,
    STEP_FIELDS,
    DeviceSample,
    Hello,
    Message,
    Metrics,
    ProtocolError,
    StepRecord,
    _clock_message,
    _decode_object,
    _job,
    _obj,
    _short,
    decode_versioned,
    parse,
)

__all__ = ["NODE_FRAME_VERSION", "MAX_NODE_RECORDS", "STEP_COLUMNS", "DEVICE_COLUMNS", "PER_RANK_STEP_FIELDS",
           "NodeMetrics", "packable", "decode_frame", "encode_node"]

NODE_FRAME_VERSION = 3  # the version that added node_metrics; per-rank frames speak 1 or 2
# Records (steps, device samples) of one node frame: each rank's own frame may hold 2,048;
# a node of 8 ranks flushing once a second at 100 steps/s holds 800 of them.
MAX_NODE_RECORDS = 8 * MAX_RECORDS_PER_MESSAGE

# A column's check: (kind, lo, hi, required). Kinds: "int", "float", "str" (one of the
# allowed words), "reasons" (a list of short strings), "gc" (3 floats). Optional columns
# hold null where a record has no value.
_Spec = tuple[str, float, float, bool]
STEP_COLUMNS: dict[str, _Spec] = {
    "batch_index": ("int", 0, MAX_BATCH_INDEX, True),
    "local_batch_size": ("int", 0, MAX_GLOBAL_BATCH_SIZE, True),
    "placement_version": ("int", 0, MAX_VERSION, True),
    "data_wait_ms": ("float", 0.0, MAX_DURATION_MS, True),
    "compute_ms": ("float", 0.0, MAX_DURATION_MS, True),
    "sync_wait_ms": ("float", 0.0, MAX_DURATION_MS, True),
    "optimizer_ms": ("float", 0.0, MAX_DURATION_MS, True),
    "step_ms": ("float", 0.0, MAX_DURATION_MS, True),
    "t": ("float", 0.0, _MAX_UNIX_TIME, True),
    "mem_peak_bytes": ("int", 0, MAX_BYTES, False),
    "mem_reserved_bytes": ("int", 0, MAX_BYTES, False),
    "mem_total_bytes": ("int", 0, MAX_BYTES, False),
    "work": ("float", 0.0, MAX_WORK, False),
    "batch_work": ("float", 0.0, MAX_WORK, False),
    "comm_bytes": ("int", 1, MAX_BYTES, False),
    "comm_ms": ("float", 0.0, MAX_DURATION_MS, False),
    "work_sq": ("float", 0.0, MAX_WORK_SQ, False),
    "batch_work_sq": ("float", 0.0, MAX_WORK_SQ, False),
    "slowest_rank": ("int", 0, MAX_WORLD_SIZE - 1, False),
    "host_ms": ("float", 0.0, MAX_DURATION_MS, False),
    "ckpt_ms": ("float", 0.0, MAX_DURATION_MS, False),
    "gc_ms": ("gc", 0.0, MAX_DURATION_MS, False),
}
DEVICE_COLUMNS: dict[str, _Spec] = {
    "t": ("float", 0.0, _MAX_UNIX_TIME, True),
    "source": ("str", 0, 0, True),
    "util_pct": ("float", 0.0, _MAX_PCT, False),
    "mem_used_bytes": ("int", 0, MAX_BYTES, False),
    "mem_total_bytes": ("int", 0, MAX_BYTES, False),
    "power_w": ("float", 0.0, _MAX_POWER_W, False),
    "temp_c": ("float", -273.0, _MAX_TEMP_C, False),
    "sm_clock_mhz": ("float", 0.0, _MAX_CLOCK_MHZ, False),
    "sm_clock_max_mhz": ("float", 0.0, _MAX_CLOCK_MHZ, False),
    "throttle_reasons": ("reasons", 0, 0, False),
    "cpu_pct": ("float", 0.0, _MAX_CPU_PCT, False),
    "rss_bytes": ("int", 0, MAX_BYTES, False),
    **{f: ("float", 0.0, MAX_LINK_BYTES_PER_S, False) for f in LINK_FIELDS},
}
# Step fields a node frame does not carry: a pipeline leader's stage times (their checks need
# its hello's pipeline shape). A frame with any of them goes per rank (``packable``).
PER_RANK_STEP_FIELDS = frozenset(_PIPELINE_KEYS)
_SOURCES = frozenset(("nvml", "psutil"))
_INT = frozenset((int,))
_STR = frozenset((str,))


def _bad(where: str, i: int, val: Any, expected: str) -> ProtocolError:
    return ProtocolError(f"'{where}[{i}]' must be {expected}, got {_short(val)}.")


def _raise_first_bad(where: str, col: list[Any], required: bool, ok: Callable[[Any], bool], expected: str) -> None:
    """ProtocolError for the first value of ``col`` that is not ``ok`` (None passes where the
    column is optional); nothing when every value is."""
    for i, x in enumerate(col):
        if x is None and not required:
            continue
        if not ok(x):
            raise _bad(where, i, x, expected + ("" if required else " or null"))


def _check_column(where: str, col: Any, n: int, spec: _Spec) -> list[Any]:
    """``col`` as a checked list of ``n`` values (floats as floats), or ProtocolError naming
    the first value off. Whole-column tests first (one pass in C); per value only on failure."""
    kind, lo, hi, required = spec
    if not isinstance(col, list):
        raise ProtocolError(f"'{where}' must be a list, got {type(col).__name__}.")
    if len(col) != n:
        raise ProtocolError(f"'{where}' holds {len(col)} values, but the frame's counts say {n} records: "
                            f"every column holds one value per record.")
    if not n:
        return col
    values = col if required else [x for x in col if x is not None]
    # Whole-column checks in C: the types present (a set of them), then min and max. A float
    # column's sum is finite only when every value is (NaN and infinities spread through it;
    # the bounds keep a sum of 16,384 values far from overflow).
    if kind == "int":
        if not values or (set(map(type, values)) <= _INT and lo <= min(values) and max(values) <= hi):
            return col
        _raise_first_bad(where, col, required, lambda x: type(x) is int and lo <= x <= hi,
                         f"an integer between {lo:.0f} and {hi:.0f}")
    elif kind == "float":
        if not values or (set(map(type, values)) <= _NUMBER_TYPES and math.isfinite(sum(values))
                          and lo <= min(values) and max(values) <= hi):
            return [x if x is None else float(x) for x in col] if not required else list(map(float, col))
        _raise_first_bad(where, col, required, lambda x: type(x) in _NUMBER_TYPES and lo <= x <= hi,
                         f"a number between {lo:g} and {hi:g}")
    elif kind == "str":
        if set(map(type, col)) <= _STR and set(col) <= _SOURCES:
            return col
        for i, x in enumerate(col):
            if type(x) is not str or x not in _SOURCES:
                raise _bad(where, i, x, "'nvml' or 'psutil'")
    elif kind == "reasons":
        for i, x in enumerate(col):
            if x is None:
                continue
            if (not isinstance(x, list) or len(x) > 32
                    or any(not isinstance(r, str) or len(r) > 64 or "\x00" in r for r in x)):
                raise _bad(where, i, x, "a list of at most 32 short strings")
    else:  # gc: [gen0, gen1, gen2] or null
        out = list(col)
        for i, x in enumerate(col):
            if x is None:
                continue
            if (not isinstance(x, list) or len(x) != 3
                    or any(type(v) not in _NUMBER_TYPES or not lo <= v <= hi for v in x)):
                raise _bad(where, i, x, f"a list of 3 numbers between 0 and {hi:g} (ms of GC per generation)")
            out[i] = [float(v) for v in x]
        return out
    return col


def _counts(d: Mapping[str, Any], key: str, n_ranks: int) -> list[int]:
    got = d.get(key, None)
    if got is None:
        return [0] * n_ranks
    if (not isinstance(got, list) or len(got) != n_ranks
            or any(type(x) is not int or not 0 <= x <= MAX_NODE_RECORDS for x in got)):
        raise ProtocolError(f"'{key}' must list one count per rank of 'ranks' ({n_ranks}), each between 0 and "
                            f"{MAX_NODE_RECORDS}, got {_short(got)}.")
    return got


def _columns(d: Mapping[str, Any], key: str, specs: Mapping[str, _Spec], n: int) -> dict[str, list[Any]]:
    raw = d.get(key)
    if raw is None:
        raw = {}
    cols = _obj(raw, f"'{key}'")
    out: dict[str, list[Any]] = {}
    for name, spec in specs.items():
        col = cols.get(name)
        if col is None:
            if spec[3] and n:
                raise ProtocolError(f"'{key}.{name}' is required: one value per record.")
            continue
        out[name] = _check_column(f"{key}.{name}", col, n, spec)
    return out


@dataclass(kw_only=True, slots=True)
class NodeMetrics:
    """The step records and device samples of several ranks of one job, by column.

    ``ranks[i]`` owns ``n_steps[i]`` consecutive values of every ``steps`` column and
    ``n_device[i]`` of every ``device`` column; ``dropped[i]`` counts its records its hook
    could not buffer, ``total_steps[i]`` (or None) is as in ``metrics``, ``urgent`` lists the
    ranks whose hook flushed early. Optional columns are absent when no record has them."""

    TYPE: ClassVar[str] = "node_metrics"
    job: str
    ranks: list[int]
    n_steps: list[int]
    steps: dict[str, list[Any]] = field(default_factory=dict)
    n_device: list[int] = field(default_factory=list)
    device: dict[str, list[Any]] = field(default_factory=dict)
    dropped: list[int] = field(default_factory=list)
    total_steps: list[int | None] = field(default_factory=list)
    urgent: list[int] = field(default_factory=list)

    @property
    def records(self) -> int:
        """Step records and device samples in the frame."""
        return sum(self.n_steps) + sum(self.n_device)

    def spans(self) -> list[tuple[int, int, int, int, int]]:
        """``(rank, first step, end step, first device sample, end)`` per rank, in frame order."""
        out, s, dv = [], 0, 0
        for rank, ns, nd in zip(self.ranks, self.n_steps, self.n_device, strict=True):
            out.append((rank, s, s + ns, dv, dv + nd))
            s, dv = s + ns, dv + nd
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NodeMetrics:
        job = _job(d)
        ranks = d.get("ranks")
        if (not isinstance(ranks, list) or not 1 <= len(ranks) <= MAX_RANKS_PER_CONNECTION
                or any(type(r) is not int or not 0 <= r < MAX_WORLD_SIZE for r in ranks)):
            raise ProtocolError(f"'ranks' must list 1 to {MAX_RANKS_PER_CONNECTION} ranks, each between 0 and "
                                f"{MAX_WORLD_SIZE - 1}, got {_short(ranks)}.")
        if len(set(ranks)) != len(ranks):
            raise ProtocolError("'ranks' names a rank twice; a node frame holds each rank's records once.")
        k = len(ranks)
        n_steps, n_device = _counts(d, "n_steps", k), _counts(d, "n_device", k)
        ns, nd = sum(n_steps), sum(n_device)
        if ns > MAX_NODE_RECORDS or nd > MAX_NODE_RECORDS:
            raise ProtocolError(f"A node frame holds at most {MAX_NODE_RECORDS} step records and as many device "
                                f"samples; this one says {ns} and {nd}. Send smaller batches.")
        dropped = _counts_or_zero(d, "dropped", k, MAX_COUNT)
        total = d.get("total_steps")
        if total is not None and (not isinstance(total, list) or len(total) != k or any(
                x is not None and (type(x) is not int or not 1 <= x <= MAX_BATCH_INDEX) for x in total)):
            raise ProtocolError(f"'total_steps' must list one value per rank ({k}), each null or between 1 and "
                                f"{MAX_BATCH_INDEX}, got {_short(total)}.")
        urgent = d.get("urgent") or []
        if not isinstance(urgent, list) or any(r not in ranks for r in urgent):
            raise ProtocolError(f"'urgent' must list ranks of 'ranks', got {_short(urgent)}.")
        frame = cls(job=job, ranks=ranks, n_steps=n_steps, steps=_columns(d, "steps", STEP_COLUMNS, ns),
                    n_device=n_device, device=_columns(d, "device", DEVICE_COLUMNS, nd), dropped=dropped,
                    total_steps=list(total) if total is not None else [], urgent=list(urgent))
        frame._check_phases()
        return frame

    def _check_phases(self) -> None:
        """The parts within their whole, as in a per-rank step record."""
        c = self.steps
        host, ckpt, gc = c.get("host_ms"), c.get("ckpt_ms"), c.get("gc_ms")
        if host is not None or ckpt is not None:
            wait = c["data_wait_ms"]
            for i, w in enumerate(wait):
                parts = (host[i] or 0.0 if host else 0.0) + (ckpt[i] or 0.0 if ckpt else 0.0)
                if parts > w * (1 + 1e-9) + _PHASE_SLACK_MS:
                    raise ProtocolError(f"'steps.host_ms[{i}]' + 'steps.ckpt_ms[{i}]' ({parts:g}) must not exceed "
                                        f"'steps.data_wait_ms[{i}]' ({w:g}): they are parts of the wait before the step.")
        if gc is not None:
            for i, g in enumerate(gc):
                if g is not None and sum(g) > c["step_ms"][i] * (1 + 1e-9) + _PHASE_SLACK_MS:
                    raise ProtocolError(f"'steps.gc_ms[{i}]' sums to {sum(g):g} ms, more than 'steps.step_ms[{i}]' "
                                        f"({c['step_ms'][i]:g}): the pauses are parts of the step.")

    def check_against(self, hellos: Mapping[int, Hello], now: float,
                      last: Mapping[int, int]) -> dict[int, ProtocolError]:
        """The checks that need each rank's hello and the receiver's clock (as
        ``Metrics.check_against``): the ranks that fail, each with its first fault; the
        caller refuses those ranks alone. Ranks not in ``hellos`` are not checked."""
        bad: dict[int, ProtocolError] = {}
        lo, hi = now - MAX_AGE_S, now + MAX_AHEAD_S
        c, dv = self.steps, self.device
        ts, dts = c.get("t", []), dv.get("t", [])
        clock_ok = (not ts or (lo <= min(ts) and max(ts) <= hi)) and (not dts or (lo <= min(dts) and max(dts) <= hi))
        slowest = c.get("slowest_rank")
        for rank, s0, s1, d0, d1 in self.spans():
            hello = hellos.get(rank)
            if hello is None:  # left out by the caller
                continue
            try:
                if s1 > s0:
                    ks = c["batch_index"][s0:s1]
                    ref = last.get(rank, hello.batch_index)
                    k_lo, k_hi = min(ks), max(ks)
                    if ref - k_lo > MAX_BATCH_JUMP or k_hi - ref > MAX_BATCH_JUMP:
                        k = k_lo if ref - k_lo > MAX_BATCH_JUMP else k_hi
                        raise ProtocolError(
                            f"rank {rank}: 'batch_index' {k} is {k - ref:+d} from this rank's last ({ref}); it must be "
                            f"within {MAX_BATCH_JUMP} of it (MAX_BATCH_JUMP). A run resumed elsewhere says its batch "
                            f"index in a new hello.")
                    top = max(c["local_batch_size"][s0:s1])
                    if top > hello.global_batch_size:
                        raise ProtocolError(f"rank {rank}: 'local_batch_size' is {top} but the job's global batch is "
                                            f"{hello.global_batch_size}.")
                    if slowest is not None:
                        for x in slowest[s0:s1]:
                            if x is not None and x not in hello.replica_ranks:
                                raise ProtocolError(
                                    f"rank {rank}: 'slowest_rank' is {x}, not a member of this replica (its hello's "
                                    f"'replica_ranks' {list(hello.replica_ranks)}).")
                if not clock_ok:
                    for key, col, a, b in (("steps.t", ts, s0, s1), ("device.t", dts, d0, d1)):
                        for t in col[a:b]:
                            if not lo <= t <= hi:
                                raise ProtocolError(f"rank {rank}: " + _clock_message(key, t, now))
            except ProtocolError as exc:
                bad[rank] = exc
        return bad

    def step_rows(self) -> list[tuple[Any, ...]]:
        """Every step record as a tuple in ``STEP_FIELDS`` order (one pass, in C)."""
        c = self.steps
        return list(zip(*(c[f] for f in STEP_FIELDS), strict=True)) if self.n_steps and sum(self.n_steps) else []

    def newest_batch(self, s0: int, s1: int) -> int:
        return max(self.steps["batch_index"][s0:s1])

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": self.TYPE, "v": NODE_FRAME_VERSION, "job": self.job, "ranks": self.ranks,
                                "n_steps": self.n_steps, "steps": self.steps}
        if any(self.n_device):
            body["n_device"], body["device"] = self.n_device, self.device
        if any(self.dropped):
            body["dropped"] = self.dropped
        if any(x is not None for x in self.total_steps):
            body["total_steps"] = self.total_steps
        if self.urgent:
            body["urgent"] = self.urgent
        return body

    @classmethod
    def pack(cls, job: str, frames: Iterable[Metrics]) -> NodeMetrics:
        """One node frame of several ranks' ``metrics`` frames (a rank's several frames are
        joined in order). Frames with a ``hang`` report are not packed (send them alone)."""
        by_rank: dict[int, list[Metrics]] = {}
        for m in frames:
            if m.job != job:
                raise ValueError(f"a node frame holds one job ('{job}'), got a frame of job '{m.job}'.")
            if not packable(m):
                raise ValueError("a metrics frame with a hang report or pipeline stage times is sent alone, not packed.")
            by_rank.setdefault(m.rank, []).append(m)
        steps = [s for ms in by_rank.values() for m in ms for s in m.steps]
        device = [x for ms in by_rank.values() for m in ms for x in m.device]
        totals = [next((m.total_steps for m in reversed(ms) if m.total_steps is not None), None)
                  for ms in by_rank.values()]
        return cls(
            job=job, ranks=list(by_rank), n_steps=[sum(len(m.steps) for m in ms) for ms in by_rank.values()],
            steps=_pack_columns(steps, STEP_COLUMNS, lambda s, f: list(s.gc_ms) if f == "gc_ms" and s.gc_ms else
                                getattr(s, f)),
            n_device=[sum(len(m.device) for m in ms) for ms in by_rank.values()],
            device=_pack_columns(device, DEVICE_COLUMNS, lambda x, f: getattr(x, f)),
            dropped=[sum(m.dropped for m in ms) for ms in by_rank.values()],
            total_steps=totals if any(t is not None for t in totals) else [],
            urgent=[r for r, ms in by_rank.items() if any(m.urgent for m in ms)],
        )

    def unpack(self) -> list[Metrics]:
        """The frame as one ``metrics`` frame per rank (objects; tests and old peers)."""
        out = []
        sc = [f for f in STEP_COLUMNS if f in self.steps]
        dc = [f for f in DEVICE_COLUMNS if f in self.device]
        for i, (rank, s0, s1, d0, d1) in enumerate(self.spans()):
            steps = []
            for j in range(s0, s1):
                kw = {f: self.steps[f][j] for f in sc if self.steps[f][j] is not None}
                if "gc_ms" in kw:
                    kw["gc_ms"] = tuple(kw["gc_ms"])
                steps.append(StepRecord(**kw))
            device = []
            for j in range(d0, d1):
                kw = {f: self.device[f][j] for f in dc if self.device[f][j] is not None}
                kw["throttle_reasons"] = list(kw.get("throttle_reasons") or [])
                device.append(DeviceSample(**kw))
            out.append(Metrics(job=self.job, rank=rank, steps=steps, device=device,
                               dropped=self.dropped[i] if self.dropped else 0,
                               total_steps=self.total_steps[i] if self.total_steps else None,
                               urgent=rank in self.urgent))
        return out


def packable(msg: Metrics) -> bool:
    """Whether ``msg`` may travel in a node frame: no hang report, no pipeline stage times."""
    return msg.hang is None and not any(getattr(s, f) is not None for s in msg.steps for f in PER_RANK_STEP_FIELDS)


def _counts_or_zero(d: Mapping[str, Any], key: str, k: int, hi: int) -> list[int]:
    got = d.get(key)
    if got is None:
        return [0] * k
    if not isinstance(got, list) or len(got) != k or any(type(x) is not int or not 0 <= x <= hi for x in got):
        raise ProtocolError(f"'{key}' must list one count per rank of 'ranks' ({k}), each between 0 and {hi}, "
                            f"got {_short(got)}.")
    return got


def _pack_columns(records: Sequence[Any], specs: Mapping[str, _Spec],
                  get: Callable[[Any, str], Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for name, spec in specs.items():
        col = [get(r, name) for r in records]
        if spec[3] or any(x is not None for x in col):
            out[name] = col
    if "throttle_reasons" in out and not any(out["throttle_reasons"]):
        del out["throttle_reasons"]  # all empty: absent
    return out


def encode_node(frame: NodeMetrics) -> str:
    """One compact JSON text frame (protocol version 3)."""
    return json.dumps(frame.to_dict(), separators=(",", ":"))


def decode_frame(raw: str | bytes) -> tuple[Message | NodeMetrics, int]:
    """Parse and validate a frame of either kind: a ``node_metrics`` frame (version 3), or any
    per-rank message (``protocol.decode_versioned``). ``ProtocolError`` says what is wrong."""
    obj = parse(raw)
    if isinstance(obj, dict) and obj.get("type") == NodeMetrics.TYPE:
        if obj.get("v") != NODE_FRAME_VERSION:
            raise ProtocolError(f"A 'node_metrics' frame speaks protocol version {NODE_FRAME_VERSION}, got "
                                f"{obj.get('v')!r}.")
        return NodeMetrics.from_dict(obj), NODE_FRAME_VERSION
    try:
        return _decode_object(obj)
    except ProtocolError:  # worded exactly as a per-rank frame's own decode words it
        return decode_versioned(raw)

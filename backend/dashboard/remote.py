"""A job's dashboard feed copied between replicas: the owner cuts a bounded snapshot of its
``Feed`` (``snapshot``); a replica whose dashboards watch the job checks what it reads back
(``check``) and merges it into a feed of its own (``merge``), which the hub's frames are cut
from as from any other feed. No I/O here: ``backend.cluster.fanout`` moves the JSON.

A snapshot carries the newest ``SERIES_POINTS`` series points, ``HEAT_COLUMNS`` heatmap
columns and every marker, plus the summary, the control state, the per-rank columns, the
positions and the savings sums. Points, columns and markers are merged by their batch index
or sequence, so a watcher that pulls once a second keeps its own window of the series.
"""

from __future__ import annotations

import json
import math
from typing import Any

from backend.dashboard.fold import SERIES_FIELDS, Feed
from backend.live.fleet import FleetJob, fleet_job_dict, fleet_job_from_dict

__all__ = ["SERIES_POINTS", "HEAT_COLUMNS", "MAX_SNAPSHOT_BYTES", "MAX_FLEET_ENTRY_BYTES", "snapshot", "encode",
           "check", "merge", "encode_fleet", "check_fleet"]

SERIES_POINTS = 600  # newest per-batch points per snapshot: 60 s of a job at 10 steps/s
HEAT_COLUMNS = 30  # newest heatmap columns per snapshot
MAX_SNAPSHOT_BYTES = 2 * 1024 * 1024  # above it the per-rank columns and heatmap stay out
MAX_FLEET_ENTRY_BYTES = 64 * 1024  # one job's fleet row and overview summary
_MAX_MARKERS = 200
_MAX_ID = 2**53  # JSON integers every reader keeps exact
_SERIES_KEYS = frozenset(SERIES_FIELDS)


def snapshot(feed: Feed, *, replica: str, seq: int, ranks: bool = True) -> dict[str, Any]:
    """What other replicas need of ``feed`` (the owner's, event loop only)."""
    series = list(feed.series)[-SERIES_POINTS:]
    return {
        "job": feed.job, "replica": replica, "seq": seq,
        "summary": feed.summary, "control": feed.control, "control_seq": feed.control_seq,
        "ranks": feed.ranks if ranks else None, "ranks_seq": feed.ranks_seq,
        "positions": feed.positions, "series": series, "markers": list(feed.markers),
        "heat": list(feed.heat)[-HEAT_COLUMNS:] if ranks else [],
        "saved_ms": feed.saved_ms, "measured_ms": feed.measured_ms, "uniform_ms": feed.uniform_ms,
    }


def encode(feed: Feed, *, replica: str, seq: int) -> str | None:
    """The snapshot as JSON, at most ``MAX_SNAPSHOT_BYTES`` (per-rank columns and heatmap
    dropped first); None when even that is over the limit or a number is not finite."""
    for ranks in (True, False):
        try:
            text = json.dumps(snapshot(feed, replica=replica, seq=seq, ranks=ranks), separators=(",", ":"),
                              allow_nan=False)
        except ValueError:
            return None
        if len(text.encode()) <= MAX_SNAPSHOT_BYTES:
            return text
    return None


def _int(data: dict[str, Any], key: str, lo: int = 0, hi: int = _MAX_ID) -> int:
    v = data.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"snapshot.{key} must be an integer between {lo} and {hi}, got {v!r}.")
    return v


def _list(data: dict[str, Any], key: str, limit: int, order: str) -> list[dict[str, Any]]:
    items = data.get(key)
    if not isinstance(items, list) or len(items) > limit:
        raise ValueError(f"snapshot.{key} must be a list of at most {limit} entries.")
    for item in items:
        if not isinstance(item, dict) or type(item.get(order)) is not int:
            raise ValueError(f"snapshot.{key} entries must be objects with an integer {order!r}.")
    return items


def _dict(data: dict[str, Any], key: str, *, optional: bool = False) -> None:
    v = data.get(key)
    if not (isinstance(v, dict) or (optional and v is None)):
        raise ValueError(f"snapshot.{key} must be an object, got {type(v).__name__}.")


def _float(data: dict[str, Any], key: str) -> float:
    v: Any = data.get(key)
    if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
        raise ValueError(f"snapshot.{key} must be a finite number >= 0, got {v!r}.")
    return float(v)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"snapshot numbers must be finite, got {name}.")


def check(job: str, text: str | bytes) -> dict[str, Any]:
    """A snapshot read back from Redis, checked (ValueError naming the field otherwise): a
    bad one costs its job's remote view one update, never another job's."""
    if len(text) > MAX_SNAPSHOT_BYTES:
        raise ValueError(f"snapshot of job {job!r} is over {MAX_SNAPSHOT_BYTES} bytes.")
    data = json.loads(text, parse_constant=_refuse_constant)
    if not isinstance(data, dict):
        raise ValueError("snapshot must be a JSON object.")
    if data.get("job") != job:
        raise ValueError(f"snapshot.job must be {job!r}, got {data.get('job')!r}.")
    replica = data.get("replica")
    if not isinstance(replica, str) or not 1 <= len(replica) <= 64:
        raise ValueError("snapshot.replica must be a replica id of 1 to 64 characters.")
    for key in ("seq", "control_seq", "ranks_seq"):
        _int(data, key)
    for point in _list(data, "series", SERIES_POINTS, "b"):
        if not point.keys() >= _SERIES_KEYS:
            raise ValueError(f"snapshot.series entries must have the fields {', '.join(SERIES_FIELDS)}.")
    _list(data, "markers", _MAX_MARKERS, "b")
    _list(data, "heat", HEAT_COLUMNS, "seq")
    _dict(data, "summary")
    _dict(data, "control")
    _dict(data, "positions")
    _dict(data, "ranks", optional=True)
    for key in ("saved_ms", "measured_ms", "uniform_ms"):
        _float(data, key)
    return data


def encode_fleet(row: FleetJob, summary: dict[str, Any], *, replica: str, t: float) -> str | None:
    """One job's fleet row and overview summary for the other replicas' home pages and
    ``GET /api/v1/fleet`` (``t``: the owner's wall clock); None when over
    ``MAX_FLEET_ENTRY_BYTES`` or a number is not finite."""
    try:
        text = json.dumps({"replica": replica, "t": t, "row": fleet_job_dict(row), "summary": summary},
                          separators=(",", ":"), allow_nan=False)
    except ValueError:
        return None
    return text if len(text.encode()) <= MAX_FLEET_ENTRY_BYTES else None


def check_fleet(job: str, text: str | bytes) -> tuple[str, float, FleetJob, dict[str, Any]]:
    """(owner replica, its wall time, fleet row, overview summary) of a fleet entry read back
    from Redis, checked: ValueError naming the field otherwise (that job's entry only)."""
    if len(text) > MAX_FLEET_ENTRY_BYTES:
        raise ValueError(f"fleet entry of job {job!r} is over {MAX_FLEET_ENTRY_BYTES} bytes.")
    data = json.loads(text, parse_constant=_refuse_constant)
    if not isinstance(data, dict):
        raise ValueError("fleet entry must be a JSON object.")
    replica = data.get("replica")
    if not isinstance(replica, str) or not 1 <= len(replica) <= 64:
        raise ValueError("fleet entry replica must be a replica id of 1 to 64 characters.")
    t = _float(data, "t")
    row = fleet_job_from_dict(data.get("row"))
    if row.job != job:
        raise ValueError(f"fleet entry row.job must be {job!r}, got {row.job!r}.")
    _dict(data, "summary")
    if data["summary"].get("job", job) != job:
        raise ValueError(f"fleet entry summary.job must be {job!r}.")
    return replica, t, row, data["summary"]


def merge(feed: Feed, data: dict[str, Any]) -> None:
    """Bring a watcher's ``feed`` up to a checked snapshot of the same owner."""
    last_b = feed.series[-1]["b"] if feed.series else -1
    feed.series.extend(p for p in data["series"] if p["b"] > last_b)
    last_m = feed.markers[-1]["b"] if feed.markers else -1
    feed.markers.extend(m for m in data["markers"] if m["b"] > last_m)
    last_h = feed.heat[-1]["seq"] if feed.heat else 0
    feed.heat.extend(h for h in data["heat"] if h["seq"] > last_h)
    feed.summary = data["summary"]
    feed.positions = data["positions"]
    if data["control_seq"] != feed.control_seq:
        feed.control, feed.control_seq = data["control"], data["control_seq"]
        feed.control_json = json.dumps(feed.control, separators=(",", ":"))
    if data["ranks"] is not None and data["ranks_seq"] != feed.ranks_seq:
        feed.ranks, feed.ranks_seq = data["ranks"], data["ranks_seq"]
        feed.ranks_json = json.dumps(feed.ranks, separators=(",", ":"))
    feed.saved_ms, feed.measured_ms, feed.uniform_ms = data["saved_ms"], data["measured_ms"], data["uniform_ms"]

"""The in-memory layout of what the hooks send: step and device records as plain tuples.

Owns no state: live state's ring buffers, the dashboard hub, the control inputs and the
persistence windows read buffered rows through these names.

The rows are plain tuples of numbers and strings, not ``StepRecord`` / ``DeviceSample``
objects: the cyclic garbage collector stops tracking such tuples, so two million buffered
steps (1,024 ranks) cost a full collection nothing. As objects they made every full
collection walk them all, stopping every thread for 0.4 s and more (1,024 ranks, 30 s in;
seconds once the buffers are full).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Final

from backend.policy.comm import CommStep
from rebalancer_wire.node import NodeMetrics
from rebalancer_wire.protocol import LINK_FIELDS, STEP_FIELDS, STEP_TIMES, DeviceSample, StepRecord

__all__ = ["STEP_FIELDS", "DEVICE_FIELDS", "STEP_BATCH", "STEP_LOCAL_BATCH", "STEP_VERSION",
           "STEP_COMPUTE", "STEP_MS", "STEP_T", "TIME_COLUMNS", "StepRow", "DeviceRow",
           "step_row", "device_row", "node_device_rows", "step_record", "device_sample", "comm_steps"]

# A buffered step is a plain tuple in the protocol's ``STEP_FIELDS`` order; these index it
# (literals, so that type checkers know each column's type; tests/test_record_shape.py
# holds them to ``STEP_FIELDS``).
STEP_BATCH: Final = 0
STEP_LOCAL_BATCH: Final = 1
STEP_VERSION: Final = 2
STEP_COMPUTE: Final = 4
STEP_MS: Final = 7
STEP_T: Final = 8
TIME_COLUMNS = tuple(STEP_FIELDS.index(f) for f in STEP_TIMES)  # the STEP_TIMES, as indices
DEVICE_FIELDS = ("t", "source", "util_pct", "mem_used_bytes", "mem_total_bytes", "power_w",
                 "temp_c", "sm_clock_mhz", "sm_clock_max_mhz", "throttle_reasons", "cpu_pct",
                 "rss_bytes", *LINK_FIELDS)
StepRow = tuple[int, int, int, float, float, float, float, float, float]  # STEP_FIELDS
DeviceRow = tuple[Any, ...]  # DEVICE_FIELDS, throttle_reasons as a tuple
step_row = attrgetter(*STEP_FIELDS)  # StepRecord -> StepRow
_device_attrs = attrgetter(*DEVICE_FIELDS)


def device_row(d: DeviceSample) -> DeviceRow:
    row = _device_attrs(d)
    return (*row[:9], tuple(row[9]), *row[10:])


def node_device_rows(frame: NodeMetrics) -> list[DeviceRow]:
    """A node frame's device samples as rows (``DEVICE_FIELDS`` order), zipped from its
    columns; a column the frame leaves out is None (throttle reasons: empty)."""
    n = sum(frame.n_device)
    if not n:
        return []
    cols = frame.device
    none = [None] * n
    reasons = cols.get("throttle_reasons")
    ordered = [cols.get(f, none) for f in DEVICE_FIELDS]
    ordered[9] = [tuple(x) if x else () for x in reasons] if reasons is not None else [()] * n
    return list(zip(*ordered, strict=True))


def step_record(row: StepRow) -> StepRecord:
    fields: dict[str, Any] = dict(zip(STEP_FIELDS, row, strict=True))
    return StepRecord(**fields)


def device_sample(row: DeviceRow) -> DeviceSample:
    return DeviceSample(t=row[0], source=row[1], util_pct=row[2], mem_used_bytes=row[3],
                        mem_total_bytes=row[4], power_w=row[5], temp_c=row[6], sm_clock_mhz=row[7],
                        sm_clock_max_mhz=row[8], throttle_reasons=list(row[9]), cpu_pct=row[10],
                        rss_bytes=row[11], **dict(zip(LINK_FIELDS, row[12:], strict=True)))


def comm_steps(rows: list[StepRow], comm: list[tuple[int, int, float | None]]) -> list[CommStep]:
    """A rank's step rows, newest first, as ``CommStep``s oldest first, each with the
    ``(batch_index, comm_bytes, comm_ms)`` of ``comm`` (newest first) for its batch."""
    by_k = {c[0]: c for c in comm}
    out = []
    for row in reversed(rows):
        c = by_k.get(row[STEP_BATCH])
        out.append(CommStep(row[STEP_BATCH], row[4], row[5], row[3], row[STEP_MS],
                            c[1] if c else None, c[2] if c else None))
    return out

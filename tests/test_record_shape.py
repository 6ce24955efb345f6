"""The step record has one definition (``rebalancer_wire.protocol.STEP_FIELDS`` / ``STEP_TIMES``);
every place that must spell its fields out (a typed model, a table, a response schema, a
client type, a feed's columns) carries the same names, with the same kind of value.

Where code can derive from the definition it does (live state's row layout, its views'
means, the stored windows' means, the dashboard's per-rank columns); what cannot (pydantic
and ORM classes, TypedDicts, a frozen migration) is held to it here."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from sqlalchemy import Float

from backend import client
from backend.api.routes import jobs as job_routes
from backend.dashboard import fold
from backend.live import rows, state, windows
from backend.storage.metrics import RankMetricRow
from backend.storage.reports import RankTotals
from rebalancer_wire.protocol import STEP_FIELDS, STEP_TIMES, StepRecord


def test_the_definition_is_the_wire_records():
    fields = [f.name for f in dataclasses.fields(StepRecord)]
    assert tuple(fields[: len(STEP_FIELDS)]) == STEP_FIELDS  # then the optional memory fields
    assert set(STEP_TIMES) <= set(STEP_FIELDS) and len(set(STEP_TIMES)) == len(STEP_TIMES)
    assert all(f.endswith("_ms") for f in STEP_TIMES)
    assert rows.STEP_FIELDS is STEP_FIELDS  # live rows are laid out by the definition
    for index, name in ((rows.STEP_BATCH, "batch_index"), (rows.STEP_LOCAL_BATCH, "local_batch_size"),
                        (rows.STEP_VERSION, "placement_version"), (rows.STEP_COMPUTE, "compute_ms"),
                        (rows.STEP_MS, "step_ms"), (rows.STEP_T, "t")):
        assert STEP_FIELDS[index] == name


def _dataclass_fields(cls: type) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _pydantic_fields(cls: typing.Any) -> dict[str, object]:
    return {name: f.annotation for name, f in cls.model_fields.items()}


@pytest.mark.parametrize(("where", "fields"), [
    ("live RankView", lambda: _dataclass_fields(state.RankView)),
    ("live Window (what is stored)", lambda: _dataclass_fields(windows.Window)),
    ("report RankTotals", lambda: _dataclass_fields(RankTotals)),
    ("REST RankPublic", lambda: _pydantic_fields(job_routes.RankPublic)),
    ("REST MetricPoint", lambda: _pydantic_fields(job_routes.MetricPoint)),
    ("client Rank", lambda: typing.get_type_hints(client.Rank)),
    ("client MetricPoint", lambda: typing.get_type_hints(client.MetricPoint)),
])
def test_every_restatement_carries_the_step_times_as_floats(where: str, fields: typing.Callable[[], dict[str, object]]):
    got = fields()
    missing = [f for f in STEP_TIMES if f not in got]
    assert not missing, f"{where} lacks {missing}"
    for f in STEP_TIMES:
        assert got[f] in (float, float | None, typing.Optional[float]), f"{where}.{f} is {got[f]}"  # noqa: UP045


def test_the_stored_windows_and_the_dashboard_columns_carry_them():
    cols = RankMetricRow.__table__.columns
    for f in STEP_TIMES:
        assert f in cols and isinstance(cols[f].type, Float), f
    assert set(STEP_TIMES) <= set(fold.RANK_COLUMNS)

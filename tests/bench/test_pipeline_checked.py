"""bench.pipeline's line per placement: the stage model's prediction on record beside the
step measured by the backend's check, steady in the run (its steps under the split after the
first two) and in the sweep (the same split)."""

from __future__ import annotations

import pytest

from bench.pipeline import _checked


def _placement(version: int, shares: list[int], prediction: dict | None) -> dict:
    return {"version": version, "shares": shares, "source": "auto", "effect": {"prediction": prediction}}


def test_each_placement_with_a_prediction_is_set_beside_three_measures():
    pred = {"predicted_step_ms": 100.0, "rest_ms": 5.0, "measured_step_ms": 104.0, "error": 0.04, "missed": False,
            "note": "within 10% (+4.0% on the step)",
            "pipelines": [{"predicted_ms": 95.0, "measured_ms": 99.0}, {"predicted_ms": 90.0, "measured_ms": None}]}
    steps = [{"shares": [6, 6], "step_ms": 150.0}] * 3 + [{"shares": [8, 4], "step_ms": x}
                                                           for x in (300.0, 200.0, 110.0, 90.0, 108.0)]
    got = _checked([_placement(1, [8, 4], pred), _placement(0, [6, 6], None)], steps, {(8, 4): 95.0})
    assert len(got) == 1
    c = got[0]
    assert (c["version"], c["split"], c["predicted_step_ms"]) == (1, [8, 4], 100.0)
    assert c["predicted_pipeline_ms"] == [95.0, 90.0] and c["measured_pipeline_ms"] == [99.0, None]
    assert (c["backend_measured_step_ms"], c["backend_error"]) == (104.0, 0.04)
    assert c["run_measured_step_ms"] == 108.0 and c["run_error"] == pytest.approx(0.08)  # 300, 200 left out
    assert c["sweep_step_ms"] == 95.0 and c["sweep_error"] == pytest.approx(-0.05)

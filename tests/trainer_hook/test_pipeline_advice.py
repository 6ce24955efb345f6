"""Stage-split advice for a real hook job (issue 40 item 4): a PP2 x DP2 torchrun job whose
last stage is heavy (layers 2 and 3 cost three times layers 0 and 1, split 2/2) reports its
stages' layers (torchtitan layout: a ``layers`` ModuleDict per stage module), and the
backend's pipeline view over REST advises moving a layer off the last stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.server import running_server
from tests.helpers.torchrun import run_torchrun

JOB = "pp-heavy-last"


@pytest.mark.multiproc
def test_a_heavy_last_stage_gets_advice_moving_layers_off_it(tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    with running_server(tmp_path) as server:
        run_torchrun(4, ["bench/_pipeline_worker.py", "--result", str(result), "--server", server.url,
                         "--job", JOB, "--speeds", "1,1", "--micro-batches", "8", "--steps", "14",
                         "--layer-ms", "2,2,6,6", "--split", "2,2"], timeout=150)
    view = json.loads(result.read_text())["pipeline_view"]
    assert view["layers_per_stage"] == [2, 2], view
    advice = view["advice"]
    assert advice is not None, view
    assert advice["bottleneck_stage"] == 1
    assert advice["current_layers_per_stage"] == [2, 2]
    assert advice["layers_per_stage"] == [3, 1], advice
    assert advice["module_names_per_stage"] == [["layers.0", "layers.1", "layers.2"], ["layers.3"]]
    assert advice["step_ms_after"] < advice["step_ms_before"] and advice["gain"] >= 0.05
    # The advice's stages: the last one's load shrinks below what the first one's grows to.
    before, after = advice["stage_ms_before"], advice["stage_ms_after"]
    assert before[1] > before[0] and max(after) < max(before)

"""Stop a micro-batch job and resume it (issue 41): each rank's stream goes on where it
stood, so no sample is trained twice and none is skipped. Real parts: Hugging Face
``datasets`` streaming over local JSON files, ``split_dataset_by_node``, torchdata's
``StatefulDataLoader``; and a plain generator, which the hook fast-forwards."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.configs import read_ranks
from tests.helpers.torchrun import REPO_ROOT, run_torchrun

pytest.importorskip("datasets", reason="the [streaming] extra: pip install 'torch-rebalancer[streaming]'")
pytest.importorskip("torchdata", reason="the [streaming] extra: pip install 'torch-rebalancer[streaming]'")

FILES, ROWS_PER_FILE = 4, 40
STEPS = 5  # per phase
CONFIGS = [["--source", "hf"], ["--source", "plain"]]


def _launch(out: Path, ckpt: Path, data: Path, phase: str, plan: str) -> list[list[dict[str, Any]]]:
    out.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(data.parent / "hf_home")}
    run_torchrun(2, ["tests/trainer_hook/_stream_resume_worker.py", "--out", str(out), "--ckpt", str(ckpt),
                     "--data", str(data), "--phase", phase, "--steps", str(STEPS), "--plan", plan,
                     "--configs", json.dumps(CONFIGS)], env=env, timeout=200)
    return [read_ranks(out / f"cfg{i}", 2) for i in range(len(CONFIGS))]


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[list[dict]], list[list[dict]]]:
    root = tmp_path_factory.mktemp("resume")
    data = root / "data"
    data.mkdir()
    for f in range(FILES):
        with open(data / f"part{f}.jsonl", "w") as fh:
            for j in range(ROWS_PER_FILE):
                fh.write(json.dumps({"id": f * 1000 + j, "text": f"doc {f}-{j}"}) + "\n")
    # Uneven from step 2 (exchanges every 2 steps, lag 1); the resumed run changes again.
    first = _launch(root / "first", root / "ckpt", data, "first", "1=1,3")
    resumed = _launch(root / "resumed", root / "ckpt", data, "resume", "6=3,1")
    return first, resumed


@pytest.mark.multiproc
@pytest.mark.timeout(480)  # the fixture's two launches, each bounded at 200 s
@pytest.mark.parametrize("cfg", range(len(CONFIGS)), ids=["hf-stateful-loader", "plain-iterator"])
def test_a_resumed_run_trains_no_sample_twice_and_skips_none(phases: Any, cfg: int) -> None:
    first, resumed = phases[0][cfg], phases[1][cfg]
    assert [d["first_step"] for d in resumed] == [STEPS, STEPS]
    assert resumed[0]["shares"][0] == [1, 3], "the resumed run lost the placement in force"
    assert [3, 1] in resumed[0]["shares"]
    # The StatefulDataLoader's own state carried the resume; the generator was fast-forwarded.
    assert all(d["source_state"] == (CONFIGS[cfg][1] == "hf") for d in first + resumed)
    for r in range(2):
        trained = [i for step in first[r]["ids"] + resumed[r]["ids"] for i in step]
        assert len(trained) == len(set(trained)), f"rank {r} trained a sample twice"
        # The rank's stream read in order with nothing left out: a prefix of its shard.
        if CONFIGS[cfg][1] == "plain":
            assert trained == list(range(r * 10_000, r * 10_000 + len(trained)))
        else:
            mine = [f * 1000 + j for f in range(FILES) if f % 2 == r for j in range(ROWS_PER_FILE)]
            assert trained == mine[:len(trained)]
    per_step = [sum(len(d["ids"][s]) for d in first) for s in range(STEPS)]
    assert per_step == [8] * STEPS  # 4 micro-batches of 2 samples every step, whatever the split

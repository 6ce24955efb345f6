"""Per-step communication from the hook: bytes handed to the all-reduce and time inside it.

A real 2-rank gloo job (one per comm hook: the C++ one and the Python one) where rank 1
sleeps per sample: rank 0 arrives first at every all-reduce and waits there for rank 1.
DDP's buckets carry the parameters' gradients, so the bytes per step are the parameters'
bytes; the last arriver's time inside the collectives is the transfer alone, and the
first arriver's is that plus the wait for its peer.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from rebalancer_wire.protocol import ProtocolError, StepRecord
from tests.helpers.torchrun import run_torchrun

pytestmark = pytest.mark.timeout(300)

DELAY_MS = 2.0  # per sample on rank 1; 8 samples a step: 16 ms of extra compute
STEPS = 14


@pytest.fixture(scope="module", params=["native", "python"])
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    out = tmp_path_factory.mktemp(f"comm_{request.param}")
    env = {"REBALANCER_NATIVE_COMM_HOOK": "1" if request.param == "native" else "0"}
    run_torchrun(2, ["tests/trainer_hook/_comm_worker.py", "--out", str(out), "--steps", str(STEPS),
                     "--delay-ms", str(DELAY_MS), "--slow", "1"], env=env, timeout=250)
    got = {r: json.loads(Path(out, f"rank{r}.json").read_text()) for r in (0, 1)}
    if request.param == "python":
        assert not got[0]["native"]
    return got


def test_bytes_per_step_are_the_parameters_bytes(job: dict[int, Any]) -> None:
    for rank, d in job.items():
        sent = [r["comm_bytes"] for r in d["records"]]
        assert len(sent) == STEPS, rank
        assert set(sent) == {d["param_bytes"]}, rank


def test_the_first_arriver_waits_inside_the_collective_the_last_does_not(job: dict[int, Any]) -> None:
    # From step 3: step 2 collects the exchange launched at step 0 (the worker launches no other),
    # a wait in the hook's own collective, which is sync wait but not time in the all-reduce.
    recs = {rank: {r["batch_index"]: r for r in d["records"][3:]} for rank, d in job.items()}
    common = sorted(set(recs[0]) & set(recs[1]))
    fast = [recs[0][k] for k in common]
    slow = [recs[1][k] for k in common]
    for r in fast + slow:  # in flight for at least the exposed part, never past the step
        assert r["sync_wait_ms"] - 0.01 <= r["comm_ms"] <= r["step_ms"]
    # Rank 0 waits for rank 1's extra compute inside the all-reduce: its time in there is
    # the transfer plus that wait; rank 1's is the transfer alone, a small part of it.
    wait = [f["comm_ms"] - s["comm_ms"] for f, s in zip(fast, slow, strict=True)]
    extra = [s["compute_ms"] - f["compute_ms"] for f, s in zip(fast, slow, strict=True)]
    assert statistics.median(wait) == pytest.approx(statistics.median(extra), rel=0.35)
    assert statistics.median(s["comm_ms"] for s in slow) < statistics.median(wait)


def _record(**extra: Any) -> dict[str, Any]:
    return {"batch_index": 3, "local_batch_size": 8, "placement_version": 0, "data_wait_ms": 0.1,
            "compute_ms": 5.0, "sync_wait_ms": 1.0, "optimizer_ms": 0.5, "step_ms": 6.6, "t": 1.7e9, **extra}


def test_the_record_carries_communication_only_where_measured() -> None:
    rec = StepRecord.from_dict(_record(comm_bytes=4096, comm_ms=2.5))
    assert (rec.comm_bytes, rec.comm_ms) == (4096, 2.5)
    assert StepRecord.from_dict(rec.to_dict()) == rec
    bare = StepRecord.from_dict(_record())
    assert (bare.comm_bytes, bare.comm_ms) == (None, None)
    assert "comm_bytes" not in bare.to_dict() and "comm_ms" not in bare.to_dict()
    only_bytes = StepRecord.from_dict(_record(comm_bytes=4096))
    assert (only_bytes.comm_bytes, only_bytes.comm_ms) == (4096, None)


@pytest.mark.parametrize(("extra", "message"), [
    ({"comm_bytes": 0, "comm_ms": 1.0}, "'comm_bytes' must be between 1 and 9007199254740992, got 0."),
    ({"comm_bytes": -5}, "'comm_bytes' must be between 1 and 9007199254740992, got -5."),
    ({"comm_bytes": 10, "comm_ms": -1.0}, "'comm_ms' must be a number between 0 and 86400000, got -1.0."),
    ({"comm_bytes": 10, "comm_ms": "x"}, "'comm_ms' must be a number, got str."),
])
def test_bad_communication_fields_are_refused_by_name(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        StepRecord.from_dict(_record(**extra))
    assert str(exc.value) == message

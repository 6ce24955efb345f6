"""The what-if on a real CPU job (torchrun, gloo, 3 ranks): a cause injected, the top cause
named, and its predicted gain against the gain measured when the cause is removed for real,
both from one run (tests/backend/_causes_worker.py: a phase with the cause, a clean phase).
One torchrun job for the module."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from backend.policy.causes import CauseStep, attribute
from rebalancer_wire.protocol import StepRecord
from tests.helpers.torchrun import run_torchrun

NPROC = 3
PHASE_STEPS = 25
WARMUP = 4  # each phase's first steps: the previous phase's state still drains
GLOBAL_BATCH = 12


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, list[CauseStep]]]:
    out: Path = tmp_path_factory.mktemp("causes_job")
    # Causes of 32-40 ms a step, so a loaded machine's jitter (a few ms) stays well inside 10%.
    run_torchrun(NPROC, ["-m", "tests.backend._causes_worker", "--out", str(out), "--phase-steps", str(PHASE_STEPS),
                         "--loader-ms", "40", "--sample-ms", "8"], timeout=240)
    by_phase: dict[str, dict[int, list[CauseStep]]] = {}
    for rank in range(NPROC):
        rows: list[dict[str, Any]] = json.loads((out / f"rank{rank}.json").read_text())
        for row in rows:
            phase = row.pop("phase")
            if row["batch_index"] % PHASE_STEPS < WARMUP:
                continue
            rec = StepRecord.from_dict(row)  # the wire's edge checks the phases add up
            by_phase.setdefault(phase, {}).setdefault(rank, []).append(CauseStep(
                batch_index=rec.batch_index, local_batch_size=rec.local_batch_size,
                data_wait_ms=rec.data_wait_ms, compute_ms=rec.compute_ms, sync_wait_ms=rec.sync_wait_ms,
                optimizer_ms=rec.optimizer_ms, step_ms=rec.step_ms, host_ms=rec.host_ms or 0.0,
                ckpt_ms=rec.ckpt_ms or 0.0, gc_ms=sum(rec.gc_ms) if rec.gc_ms else 0.0))
    return by_phase


def _step_ms(steps: dict[int, list[CauseStep]]) -> float:
    """The phase's measured step: the median over steps of the ranks' median."""
    by_k: dict[int, list[float]] = {}
    for rows in steps.values():
        for s in rows:
            by_k.setdefault(s.batch_index, []).append(s.step_ms)
    return statistics.median(statistics.median(v) for v in by_k.values())


@pytest.mark.parametrize(("phase", "cause", "ranks"), [("data_wait", "data_wait", (1,)),
                                                         ("slow_rank", "slow_rank", (2,))])
def test_the_top_cause_and_its_gain_against_removing_it_for_real(phases, phase, cause, ranks):
    report = attribute(phases[phase], global_batch_size=GLOBAL_BATCH, steps_done=3 * PHASE_STEPS)
    top = report.causes[0]
    assert (top.cause, top.ranks) == (cause, ranks), report.causes
    measured = _step_ms(phases[phase]) - _step_ms(phases["clean"])
    assert measured > 20.0  # the injected cause costs 32-40 ms a step
    assert top.ms_per_step == pytest.approx(measured, rel=0.10), (top, measured)
    # The replay with nothing removed tells the measured step within 10% too.
    assert report.replayed_step_ms == pytest.approx(report.step_ms, rel=0.10)


def test_the_clean_phase_has_no_large_cause(phases):
    report = attribute(phases["clean"], global_batch_size=GLOBAL_BATCH, steps_done=PHASE_STEPS)
    assert all(c.share_of_step < 0.10 for c in report.causes), report.causes

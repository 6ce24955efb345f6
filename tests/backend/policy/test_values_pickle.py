"""The observation crosses to the policy process as a pickle: it must come back equal, field
for field, and its thousands of step and device samples must not pickle one object each."""

from __future__ import annotations

import pickle
import pickletools

from backend.policy.memory import MemoryFit, MemoryReading, RankMemory
from backend.policy.types import (
    Constraints,
    DeviceSignals,
    JobObservation,
    PolicyConfig,
    RankObservation,
    Rollback,
    StepSample,
)


def _obs(ranks: int = 3) -> JobObservation:
    return JobObservation(
        job="j", world_size=ranks, global_batch_size=12 * ranks, batch_index=40,
        shares=tuple([12] * ranks), placement_version=2, steps_since_change=7,
        ranks=tuple(RankObservation(
            rank=r, device_type="A100-80GB" if r else None, mem_total_bytes=80 * 2**30 if r else None,
            steps=tuple(StepSample(k, 12, 10.0 + k * 0.5 + r) for k in range(20)),
            device=tuple(DeviceSignals(t=float(k), util_pct=None if k % 2 else 97.5, temp_c=71.0,
                                       sm_clock_mhz=1410.0, throttle_reasons=("sw_thermal",) * (k % 2))
                         for k in range(6)),
            memory=RankMemory(source="cuda", fit=MemoryFit(1e9, 1e8, 8 * 10**10, 5, 2, "linear", 2 * 10**9, 16),
                             total_bytes=8 * 10**10, max_share=20)
            if r == 1 else RankMemory()) for r in range(ranks)),
        rollbacks=(Rollback(30, (12,) * ranks, (13, 11) + (12,) * (ranks - 2)),),
    )


def test_an_observation_comes_back_equal_from_a_pickle():
    obs = _obs()
    back = pickle.loads(pickle.dumps(obs, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == obs
    assert type(back.ranks[1].steps[3]) is StepSample and type(back.ranks[1].device[2]) is DeviceSignals
    for value in (PolicyConfig(), Constraints(pins={0: 4}), obs.ranks[1].memory, MemoryReading(12, 2 * 10**9)):
        assert pickle.loads(pickle.dumps(value)) == value


def test_step_and_device_samples_travel_as_plain_tuples():
    data = pickle.dumps(_obs(ranks=4), protocol=pickle.HIGHEST_PROTOCOL)
    names = [arg for op, arg, _ in pickletools.genops(data) if op.name in ("SHORT_BINUNICODE", "BINUNICODE")]
    assert "StepSample" not in names and "DeviceSignals" not in names  # rebuilt on the other side

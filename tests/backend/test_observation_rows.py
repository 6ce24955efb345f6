"""What the policy sees of a job: ``inputs.observation_rows`` (rows copied from live state,
objects built where the policy runs by ``build()``) carries each rank's measured steps and device signals field for
field, and a pickle of the rows builds the same observation on the other side."""

from __future__ import annotations

import pickle

from backend.control import inputs
from backend.live.state import LiveState
from backend.policy.types import DeviceSignals, ObservationRows, StepSample
from rebalancer_wire.protocol import DeviceSample, Hello, Metrics, StepRecord


def _live() -> LiveState:
    live = LiveState()
    for r in range(2):
        live.register(Hello(job="j", rank=r, world_size=2, global_batch_size=32, device_name="NVIDIA H100 80GB HBM3",
                            mem_total_bytes=80 * 2**30))
        steps = [StepRecord(batch_index=k, local_batch_size=0 if (r, k) == (1, 3) else 16, placement_version=0,
                            data_wait_ms=0.1, compute_ms=10.0 + k + 100 * r, sync_wait_ms=1.0, optimizer_ms=0.5,
                            step_ms=12.0 + k, t=1000.0 + k) for k in range(6)]
        device = [DeviceSample(t=1000.0 + k, source="nvml", util_pct=90.0 + r, mem_used_bytes=2**30 * (k + 1),
                               mem_total_bytes=80 * 2**30, power_w=300.0 + k, temp_c=60.0 + k,
                               sm_clock_mhz=1700.0 - k, sm_clock_max_mhz=1980.0,
                               throttle_reasons=["sw_thermal"] if k else []) for k in range(3)]
        live.add_metrics(Metrics(job="j", rank=r, steps=steps, device=device))
    return live


def test_each_rank_brings_its_working_steps_and_its_device_signals_field_for_field():
    kw = dict(world_size=2, global_batch_size=32, shares=[16, 16], version=0, effective=0, window_steps=4)
    rows = inputs.observation_rows(_live(), "j", **kw)
    assert isinstance(rows, ObservationRows)
    obs = rows.build()
    assert [r.rank for r in obs.ranks] == [0, 1]
    one = obs.ranks[1]
    # The newest 4 steps with samples, oldest first (batch 3 had none on rank 1).
    assert one.steps == (StepSample(1, 16, 111.0), StepSample(2, 16, 112.0), StepSample(4, 16, 114.0),
                         StepSample(5, 16, 115.0))
    assert one.device[-1] == DeviceSignals(t=1002.0, util_pct=91.0, mem_used_bytes=3 * 2**30,
                                           mem_total_bytes=80 * 2**30, temp_c=62.0, sm_clock_mhz=1698.0,
                                           sm_clock_max_mhz=1980.0, power_w=302.0,
                                           throttle_reasons=("sw_thermal",))
    assert one.device_type == "H100" and one.mem_total_bytes == 80 * 2**30
    assert pickle.loads(pickle.dumps(rows)).build() == obs

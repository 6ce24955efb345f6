"""The node frame's codec and checks (rebalancer_wire/node.py), and the agent's packing."""

from __future__ import annotations

import json
import time
from dataclasses import fields

import pytest

from rebalancer_wire.node import (
    DEVICE_COLUMNS,
    PER_RANK_STEP_FIELDS,
    STEP_COLUMNS,
    NodeMetrics,
    decode_frame,
    encode_node,
    packable,
)
from rebalancer_wire.protocol import (
    MAX_DURATION_MS,
    DeviceSample,
    Hang,
    Hello,
    Metrics,
    ProtocolError,
    StepRecord,
    encode,
)
from trainer_hook.node_agg import NodeAgent


def _rec(k: int, t: float, **kw: object) -> StepRecord:
    return StepRecord(batch_index=k, local_batch_size=8, placement_version=1, data_wait_ms=0.5, compute_ms=12.25,
                      sync_wait_ms=1.5, optimizer_ms=0.75, step_ms=15.0, t=t, **kw)  # type: ignore[arg-type]


def _frames(t: float) -> list[Metrics]:
    dev = DeviceSample(t=t, source="nvml", util_pct=97.0, mem_used_bytes=1 << 34, throttle_reasons=["sw_power_cap"],
                       nvlink_tx_bytes_per_s=1e10)
    return [
        Metrics(job="j", rank=0, steps=[_rec(5, t), _rec(6, t, comm_bytes=1 << 30, comm_ms=3.5)], device=[dev],
                total_steps=100),
        Metrics(job="j", rank=3, steps=[_rec(5, t, work=10.0, batch_work=40.0, work_sq=100.0, batch_work_sq=400.0,
                                             host_ms=0.25, ckpt_ms=0.125, gc_ms=(0.5, 0.0, 0.0),
                                             mem_peak_bytes=1 << 33, mem_reserved_bytes=1 << 34,
                                             mem_total_bytes=1 << 36)],
                dropped=4, urgent=True),
        Metrics(job="j", rank=1, device=[DeviceSample(t=t, source="psutil", cpu_pct=250.0, rss_bytes=1 << 30)]),
    ]


def test_every_record_field_has_a_column() -> None:
    # A field added to StepRecord or DeviceSample must say how a node frame carries it, or
    # that frames with it go per rank (a pipeline leader's stage times).
    assert set(STEP_COLUMNS) | PER_RANK_STEP_FIELDS == {f.name for f in fields(StepRecord)}
    assert not set(STEP_COLUMNS) & PER_RANK_STEP_FIELDS
    assert set(DEVICE_COLUMNS) == {f.name for f in fields(DeviceSample)}


def test_pack_encode_decode_unpack_gives_the_frames_back() -> None:
    frames = _frames(time.time())
    packed = NodeMetrics.pack("j", frames)
    assert packed.ranks == [0, 3, 1] and packed.n_steps == [2, 1, 0] and packed.n_device == [1, 0, 1]
    got, version = decode_frame(encode_node(packed))
    assert version == 3 and isinstance(got, NodeMetrics)
    assert got.unpack() == frames
    # A per-rank frame is read by the same function, as before.
    per_rank, v = decode_frame(encode(frames[0]))
    assert (per_rank, v) == (frames[0], 2)


def test_a_ranks_frames_are_joined_in_order() -> None:
    t = time.time()
    packed = NodeMetrics.pack("j", [Metrics(job="j", rank=2, steps=[_rec(1, t)], dropped=1),
                                    Metrics(job="j", rank=0, steps=[_rec(1, t)]),
                                    Metrics(job="j", rank=2, steps=[_rec(2, t)], dropped=2)])
    assert (packed.ranks, packed.n_steps, packed.dropped) == ([2, 0], [2, 1], [3, 0])
    assert packed.steps["batch_index"] == [1, 2, 1]


def _body(t: float) -> dict[str, object]:
    return NodeMetrics.pack("j", _frames(t)).to_dict()


@pytest.mark.parametrize(("change", "message"), [
    (lambda b: b["steps"]["t"].pop(),
     "'steps.t' holds 2 values, but the frame's counts say 3 records: every column holds one value per record."),
    (lambda b: b.update(ranks=[0, 3, 3]), "'ranks' names a rank twice; a node frame holds each rank's records once."),
    (lambda b: b.update(n_steps=[2, 1]),
     "'n_steps' must list one count per rank of 'ranks' (3), each between 0 and 16384, got [2, 1]."),
    (lambda b: b["steps"]["compute_ms"].__setitem__(1, -1.0),
     "'steps.compute_ms[1]' must be a number between 0 and 8.64e+07, got -1.0."),
    (lambda b: b["steps"]["batch_index"].__setitem__(0, 1.5),
     "'steps.batch_index[0]' must be an integer between 0 and 2147483647, got 1.5."),
    (lambda b: b["steps"].__delitem__("step_ms"), "'steps.step_ms' is required: one value per record."),
    (lambda b: b["device"]["source"].__setitem__(0, "x"), "'device.source[0]' must be 'nvml' or 'psutil', got 'x'."),
    (lambda b: b["steps"]["gc_ms"].__setitem__(2, [MAX_DURATION_MS, 0, 0]),
     "'steps.gc_ms[2]' sums to 8.64e+07 ms, more than 'steps.step_ms[2]' (15): the pauses are parts of the step."),
    (lambda b: b.update(urgent=[7]), "'urgent' must list ranks of 'ranks', got [7]."),
    (lambda b: b.update(v=2), "A 'node_metrics' frame speaks protocol version 3, got 2."),
])
def test_a_bad_frame_is_refused_whole_with_its_reason(change, message) -> None:  # type: ignore[no-untyped-def]
    body = _body(time.time())
    change(body)
    with pytest.raises(ProtocolError) as err:
        decode_frame(json.dumps(body))
    assert str(err.value) == message
    assert err.value.close_code == 4002


def test_the_checks_that_need_a_hello_name_each_rank_that_fails() -> None:
    now = time.time()
    frame = NodeMetrics.pack("j", _frames(now))
    hellos = {r: Hello(job="j", rank=r, world_size=4, global_batch_size=32) for r in (0, 1, 3)}
    assert frame.check_against(hellos, now, {}) == {}
    small = {**hellos, 3: Hello(job="j", rank=3, world_size=4, global_batch_size=4)}
    bad = frame.check_against(small, now, {})
    assert list(bad) == [3] and str(bad[3]) == "rank 3: 'local_batch_size' is 8 but the job's global batch is 4."
    late = frame.check_against(hellos, now + 8 * 86400, {})
    assert sorted(late) == [0, 1, 3]
    assert str(late[1]).startswith("rank 1: 'device.t' is -691200 s from the backend's clock")
    assert frame.check_against({0: hellos[0]}, now, {}) == {}  # ranks left out are not checked


def test_the_agent_packs_what_waits_into_one_node_frame_per_flush(tmp_path) -> None:  # type: ignore[no-untyped-def]
    agent = NodeAgent(job="j", path=str(tmp_path / "a.sock"), flush_s=60.0)
    t = time.time()
    frames = [Metrics(job="j", rank=r, steps=[_rec(1, t)]) for r in (1, 2, 3)]
    for m in frames:
        agent._put(m.rank, encode(m), m)
    assert agent.peek() is None  # not due: the node's flush has not come
    hang = Metrics(job="j", rank=0, steps=[_rec(1, t)], hang=Hang(batch_index=2, phase="compute", since=t, stalled_s=6))
    assert not agent.carry(encode(hang))  # sent alone by rank 0 itself
    staged = Metrics(job="j", rank=0, steps=[_rec(1, t, bubble_ms=1.0)])
    assert not packable(staged) and not agent.carry(encode(staged))  # a pipeline leader's: per rank
    assert agent.carry(encode(Metrics(job="j", rank=0, steps=[_rec(1, t)])))  # rank 0's flush: due now
    text = agent.peek()
    assert text is not None and agent.peek() == text
    got, _ = decode_frame(text)
    assert isinstance(got, NodeMetrics) and got.ranks == [1, 2, 3, 0]
    agent.pop()
    assert (agent.peek(), agent.node_frames, agent.relayed) == (None, 1, 1)
    # A control frame goes at once, and the metrics behind it wait for the next flush.
    agent._put(2, encode(Hello(job="j", rank=2, world_size=4, global_batch_size=8)))
    agent._put(1, encode(frames[0]), frames[0])
    assert json.loads(agent.peek() or "{}")["type"] == "hello"
    agent.pop()
    assert agent.peek() is None


def test_against_a_backend_older_than_node_frames_the_agent_resends_per_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    agent = NodeAgent(job="j", path=str(tmp_path / "a.sock"), flush_s=0.0)
    t = time.time()
    frames = [Metrics(job="j", rank=r, steps=[_rec(1, t)]) for r in (1, 2)]
    agent.hellos()  # a connection opens
    for m in frames:
        agent._put(m.rank, encode(m), m)
    packed = agent.peek()
    assert packed is not None and packed.startswith('{"type":"node_metrics"')
    agent.pop()  # sent; the old backend answers it with 4001
    assert agent.unpack()
    sent = []
    while (text := agent.peek()) is not None:
        sent.append(text)
        agent.pop()
    assert sent == [encode(m) for m in frames]  # the same records, each rank's frame as it was
    assert not agent.unpack()  # once only

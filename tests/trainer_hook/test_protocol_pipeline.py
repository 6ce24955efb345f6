"""The wire's pipeline fields (docs/protocol.md, docs/pipelines.md): a pipelined hello and a
pipeline leader's step records round-trip; bad shapes and stage lists are refused with a
sentence naming the field; an old hook's frames read the same."""

from __future__ import annotations

import json

import pytest

from rebalancer_wire.protocol import (
    MAX_MESSAGE_BYTES,
    MAX_RECORDS_PER_MESSAGE,
    Hello,
    Metrics,
    PipelineShape,
    ProtocolError,
    StepRecord,
    decode,
    encode,
)

HELLO = {"type": "hello", "v": 2, "job": "pp", "rank": 1, "world_size": 2, "global_batch_size": 16,
         "mesh": {"dp": 2, "replica_size": 2, "dims": ["pp", "dp"], "shape": [2, 2]}}
PIPE = {"pp_size": 2, "pp_stage": 0, "dp_index": 1, "tp_size": 1, "schedule": "1f1b", "n_stages": 2,
        "min_microbatches": 2, "layers_per_stage": [3, 2],
        "layer_names": ["tok_embeddings", "layers.0", "layers.1", "layers.2", "output"]}
STEP = dict(batch_index=4, local_batch_size=8, placement_version=1, data_wait_ms=0.5, compute_ms=40.0,
            sync_wait_ms=1.5, optimizer_ms=0.25, step_ms=45.0, t=1.7e9)
PIPE_STEP = dict(n_microbatches=8, bubble_ms=6.0, stage_fwd_ms=[1.5, 2.5], stage_bwd_ms=[3.0, 5.0],
                 stage_send_wait_ms=[0.5, 0.0], stage_recv_wait_ms=[0.0, 1.25], stage_bubble_ms=[8.0, 4.0],
                 layer_ms=[1.0, 1.5, 2.0, 3.5, 4.0])


def _hello(**pipe: object) -> Hello:
    msg = decode(json.dumps({**HELLO, "pipeline": {**PIPE, **pipe}}))
    assert isinstance(msg, Hello)
    return msg


def test_a_pipelined_hello_round_trips_and_implies_micro_batch_shares() -> None:
    hello = _hello()
    assert hello.pipeline == PipelineShape(
        pp_size=2, pp_stage=0, dp_index=1, tp_size=1, schedule="1f1b", n_stages=2, min_microbatches=2,
        layers_per_stage=(3, 2), layer_names=("tok_embeddings", "layers.0", "layers.1", "layers.2", "output"))
    assert hello.micro_batches is True  # shares count micro-batches
    assert decode(encode(hello)) == hello
    assert json.loads(encode(hello))["pipeline"] == PIPE
    assert hello.pipeline.label == "PP 2, 1f1b"
    inter = _hello(schedule="interleaved1f1b", n_stages=4, layers_per_stage=[1, 1, 2, 1], tp_size=1)
    assert inter.pipeline is not None and inter.pipeline.stages_per_rank == 2
    assert inter.pipeline.label == "PP 2, interleaved1f1b (2 stages per rank)"


def test_defaults_keep_the_pipeline_small() -> None:
    msg = decode(json.dumps({**HELLO, "pipeline": {"pp_size": 2, "schedule": "gpipe"}}))
    assert isinstance(msg, Hello) and msg.pipeline is not None
    p = msg.pipeline
    assert (p.pp_stage, p.dp_index, p.tp_size, p.n_stages, p.min_microbatches) == (0, 1, 1, 2, 1)
    # the mesh's replica of 2 ranks cannot hold 4 stages: refused where the mesh is said
    with pytest.raises(ProtocolError):
        decode(json.dumps({**HELLO, "pipeline": {"pp_size": 3, "schedule": "gpipe"}}))


def test_an_old_hello_has_no_pipeline_and_a_version_1_peer_never_sees_one() -> None:
    msg = decode(json.dumps({k: v for k, v in HELLO.items() if k != "mesh"}))
    assert isinstance(msg, Hello) and msg.pipeline is None and msg.micro_batches is False
    assert "pipeline" not in json.loads(encode(msg))
    assert "pipeline" not in json.loads(encode(_hello(), version=1))


@pytest.mark.parametrize(("pipe", "expected"), [
    ({"pp_stage": 2}, "'pipeline.pp_stage' (2) must be below 'pipeline.pp_size' (2): stages are numbered 0 to 1."),
    ({"schedule": "zb1p"}, "'pipeline.schedule' must be one of gpipe, 1f1b, interleaved1f1b, got 'zb1p'."),
    ({"schedule": None}, "'pipeline.schedule' must be one of gpipe, 1f1b, interleaved1f1b, got None."),
    ({"pp_size": 0}, "'pipeline.pp_size' must be an integer between 1 and 4096, got 0."),
    ({"pp_size": True}, "'pipeline.pp_size' must be an integer between 1 and 4096, got True."),
    ({"dp_index": 0}, "'pipeline.dp_index' (0) must equal 'rank' (1): a pipelined hook speaks for one "
                      "data-parallel pipeline, so its rank is the pipeline's dp index."),
    ({"tp_size": 2}, "'mesh.replica_size' (2) must be a multiple of 'pipeline.pp_size' x 'pipeline.tp_size' "
                     "(2 x 2): a pipeline's ranks are its replica."),
    ({"n_stages": 4}, "'pipeline.n_stages' (4) must equal 'pipeline.pp_size' (2) for 1f1b: one model stage "
                      "per pipeline rank (interleaved1f1b runs several)."),
    ({"schedule": "interleaved1f1b", "n_stages": 3, "layers_per_stage": None, "layer_names": None},
     "'pipeline.n_stages' (3) must be 2 to 64 times 'pipeline.pp_size' (2) for interleaved1f1b: each "
     "pipeline rank runs that many model stages."),
    ({"min_microbatches": 9}, "'pipeline.min_microbatches' (9) x 'world_size' (2 pipelines) is more than "
                              "'global_batch_size' (16 micro-batches): no placement could give every "
                              "pipeline its minimum."),
    ({"layers_per_stage": [3, 2, 1], "layer_names": None},
     "'pipeline.layers_per_stage' must list one layer count per model stage (2, 'pipeline.n_stages'), each "
     "0 to 16384, at most 16384 in all and not all 0, got [3, 2, 1]."),
    ({"layer_names": ["a", "b"]}, "'pipeline.layer_names' must name every layer of 'pipeline.layers_per_stage' "
                                  "(5) in model order, each 1 to 128 characters without NUL, got ['a', 'b']."),
    ({"layers_per_stage": None}, "'pipeline.layer_names' comes with 'pipeline.layers_per_stage' only: it "
                                 "names those layers."),
    ("1f1b", "'pipeline' must be a JSON object, got str."),
])
def test_a_bad_pipeline_shape_is_named(pipe: object, expected: str) -> None:
    body = {**PIPE, **pipe} if isinstance(pipe, dict) else pipe
    with pytest.raises(ProtocolError) as err:
        decode(json.dumps({**HELLO, "pipeline": body}))
    assert str(err.value) == expected


def test_micro_batches_false_with_a_pipeline_is_refused() -> None:
    with pytest.raises(ProtocolError, match="'micro_batches' must be true"):
        decode(json.dumps({**HELLO, "micro_batches": False, "pipeline": PIPE}))


def test_a_pipeline_leaders_step_round_trips_and_an_old_record_reads_the_same() -> None:
    rec = StepRecord.from_dict({**STEP, **PIPE_STEP})
    assert rec.stage_fwd_ms == (1.5, 2.5) and rec.stage_bubble_ms == (8.0, 4.0) and rec.n_microbatches == 8
    assert rec.layer_ms == (1.0, 1.5, 2.0, 3.5, 4.0)
    msg = Metrics(job="pp", rank=1, steps=[rec])
    assert decode(encode(msg)) == msg
    with_phases = StepRecord.from_dict({**STEP, **PIPE_STEP, "host_ms": 0.25, "gc_ms": [0.0, 0.0, 1.0]})
    assert with_phases.host_ms == 0.25 and with_phases.stage_bwd_ms == (3.0, 5.0)
    plain = StepRecord.from_dict(STEP)
    assert plain.stage_fwd_ms is None and plain.bubble_ms is None
    assert set(plain.to_dict()) == set(STEP)


@pytest.mark.parametrize(("fields", "expected"), [
    ({"stage_fwd_ms": [1.0]}, "The stage lists must have one entry per pipeline rank each, but their lengths "
                              "differ: stage_fwd_ms 1, stage_bwd_ms 2, stage_send_wait_ms 2, "
                              "stage_recv_wait_ms 2, stage_bubble_ms 2."),
    ({"stage_bwd_ms": [1.0, -2.0]}, "'stage_bwd_ms' must be a list of 1 to 4096 numbers (ms), each between 0 "
                                    "and 86400000, got [1.0, -2.0]."),
    ({"stage_bubble_ms": []}, "'stage_bubble_ms' must be a list of 1 to 4096 numbers (ms), each between 0 and "
                              "86400000, got []."),
    ({"stage_fwd_ms": None}, "'stage_fwd_ms' and 'stage_bwd_ms' come together: a stage's time per micro-batch "
                             "is both."),
    ({"n_microbatches": -1}, "'n_microbatches' must be between 0 and 16777216, got -1."),
    ({"bubble_ms": 46.0}, "'bubble_ms' (46) must not exceed the step's 'step_ms' (45): the bubble is part of "
                          "the step."),
    ({"layer_ms": [True]}, "'layer_ms' must be a list of 1 to 16384 numbers (ms), each between 0 and 86400000, "
                           "got [True]."),
])
def test_bad_pipeline_step_fields_are_named(fields: dict[str, object], expected: str) -> None:
    with pytest.raises(ProtocolError) as err:
        StepRecord.from_dict({**STEP, **PIPE_STEP, **fields})
    assert str(err.value) == expected


def test_a_64_stage_leaders_frame_fits() -> None:
    """The bytes docs/protocol.md states: a 64-stage record, and a frame of a window of them."""
    stages = {k: [123.456] * 64 for k in ("stage_fwd_ms", "stage_bwd_ms", "stage_send_wait_ms",
                                          "stage_recv_wait_ms", "stage_bubble_ms")}
    rec = StepRecord.from_dict({**STEP, "n_microbatches": 32, "bubble_ms": 12.5, **stages})
    one = len(json.dumps(rec.to_dict(), separators=(",", ":")))
    assert 2500 < one < 3000  # 64 stages x 5 lists x about 8 bytes
    frame = encode(Metrics(job="pp", rank=0, steps=[rec] * 256))
    assert len(frame) < MAX_MESSAGE_BYTES and 256 <= MAX_RECORDS_PER_MESSAGE


@pytest.mark.parametrize(("fields", "pipeline", "expected"), [
    ({}, None, "'steps[0]' carries pipeline stage times, but this hook's hello said no 'pipeline': say the "
               "pipeline's shape in the hello first."),
    ({k: [1.0, 2.0, 3.0] for k in ("stage_fwd_ms", "stage_bwd_ms", "stage_send_wait_ms", "stage_recv_wait_ms",
                                   "stage_bubble_ms")}, PIPE,
     "'steps[0].stage_fwd_ms' has 3 entries; this pipeline has 2 stages ('pipeline.pp_size'): give one per "
     "pipeline rank, in stage order."),
    ({"layer_ms": [1.0, 2.0]}, PIPE, "'steps[0].layer_ms' has 2 entries, but the hello's "
                                     "'pipeline.layers_per_stage' counts 5 layers: give one per layer, in model order."),
])
def test_stage_lists_are_held_to_the_hellos_shape(fields: dict[str, object], pipeline: object, expected: str) -> None:
    body = {**HELLO, "pipeline": pipeline} if pipeline is not None else HELLO
    hello = decode(json.dumps(body))
    assert isinstance(hello, Hello)
    rec = StepRecord.from_dict({**STEP, **PIPE_STEP, **fields})
    with pytest.raises(ProtocolError) as err:
        Metrics(job="pp", rank=1, steps=[rec]).check_against(hello, now=1.7e9)
    assert str(err.value) == expected
    Metrics(job="pp", rank=1, steps=[StepRecord.from_dict({**STEP, **PIPE_STEP})]).check_against(_hello(), now=1.7e9)

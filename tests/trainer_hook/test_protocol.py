"""The wire protocol refuses what it cannot trust, with a message naming the field."""

from __future__ import annotations

import json
import math

import pytest

from rebalancer_wire.protocol import (
    CLOSE_MALFORMED,
    CLOSE_TOO_BIG,
    CLOSE_UNSUPPORTED_VERSION,
    MAX_MESSAGE_BYTES,
    Hello,
    MeshShape,
    Metrics,
    ProtocolError,
    StepRecord,
    check_shares,
    decode,
    decode_versioned,
    encode,
    uniform_shares,
)

GOOD = dict(batch_index=4, local_batch_size=8, placement_version=1, data_wait_ms=0.5, compute_ms=20,
            sync_wait_ms=1.5, optimizer_ms=0.25, step_ms=23.0, t=1.7e9)


def test_step_record_round_trips_through_a_frame() -> None:
    msg = Metrics(job="j", rank=2, steps=[StepRecord(**GOOD)])
    back = decode(encode(msg))
    assert back == msg
    assert isinstance(back, Metrics) and type(back.steps[0].compute_ms) is float


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("compute_ms", math.nan, "'compute_ms' must be a number between 0 and 86400000, got nan."),
        ("compute_ms", math.inf, "'compute_ms' must be a number between 0 and 86400000, got inf."),
        ("sync_wait_ms", -1.0, "'sync_wait_ms' must be a number between 0 and 86400000, got -1.0."),
        ("t", 1e308, "'t' must be a number between 0 and 10000000000, got 1e+308."),
        ("t", 10**400, "'t' must be a number between 0 and 10000000000, got a number of 401 digits."),
        ("batch_index", 2**63, "'batch_index' must be between 0 and 2147483647, got 9223372036854775808."),
        ("local_batch_size", 2**63, "'local_batch_size' must be between 0 and 16777216, got 9223372036854775808."),
        ("step_ms", True, "'step_ms' must be a number, got bool."),
        ("t", "now", "'t' must be a number, got str."),
        ("batch_index", 1.0, "'batch_index' must be an integer, got float."),
        ("batch_index", -3, "'batch_index' must be between 0 and 2147483647, got -3."),
        ("local_batch_size", None, "'local_batch_size' is required."),
        ("work_sq", -1.0, "'work_sq' must be a number between 0 and 1e+30, got -1.0."),
        ("batch_work_sq", math.inf, "'batch_work_sq' must be a number between 0 and 1e+30, got inf."),
    ],
)
def test_bad_step_fields_are_named(key: str, value: object, expected: str) -> None:
    bad = {**GOOD, key: value}
    with pytest.raises(ProtocolError) as err:
        StepRecord.from_dict(bad)
    assert str(err.value) == expected


@pytest.mark.parametrize("key", ["job", "host", "device_name", "gpu_uuid"])
def test_a_nul_in_any_string_is_refused(key: str) -> None:
    """PostgreSQL's text cannot hold NUL: the edge refuses it before SQL fails on it."""
    frame = json.loads(encode(Hello(job="j", rank=0, world_size=1, global_batch_size=8, host="h")))
    frame[key] = "a\x00b"
    with pytest.raises(ProtocolError) as err:
        Hello.from_dict(frame)
    assert str(err.value) == f"'{key}' must not contain the NUL character (\\u0000)."


def test_missing_step_field_is_named() -> None:
    bad = {k: v for k, v in GOOD.items() if k != "optimizer_ms"}
    with pytest.raises(ProtocolError, match="'optimizer_ms' is required."):
        StepRecord.from_dict(bad)


@pytest.mark.parametrize(
    ("raw", "code", "close"),
    [
        ("{not json", "malformed", CLOSE_MALFORMED),
        ('{"type": "hello", "v": 3}', "unsupported_version", CLOSE_UNSUPPORTED_VERSION),
        ('{"type": "nope", "v": 1}', "malformed", CLOSE_MALFORMED),
        ("x" * (MAX_MESSAGE_BYTES + 1), "too_big", CLOSE_TOO_BIG),
    ],
)
def test_frames_that_break_the_envelope(raw: str, code: str, close: int) -> None:
    with pytest.raises(ProtocolError) as err:
        decode(raw)
    assert (err.value.code, err.value.close_code) == (code, close)


def _frame(step: str) -> str:
    return '{"v":2,"type":"metrics","job":"j","rank":0,"steps":[' + step + "]}"


_STEP = json.dumps(GOOD)


@pytest.mark.parametrize("raw", [
    _frame(_STEP),
    _frame(_STEP.replace('"compute_ms": 20', '"compute_ms": NaN')),
    _frame(_STEP.replace('"compute_ms": 20', '"compute_ms": -Infinity')),
    _frame(_STEP.replace('"batch_index": 4', '"batch_index": 99999999999999999999999')),
    _frame(_STEP.replace('"t": 1700000000.0', '"t": 1e999')),
    '{"v":2,"type":"metrics","job":"j","rank":0,"steps":' + "[" * 2000 + "]" * 2000 + "}",
    '{"v":2,"type":"metrics","job":"j","rank":0,"steps":[],"steps":[' + _STEP + "]}",
    '{"v":2,"type":"metrics","job":"j\ud800","rank":0}',
    _frame(_STEP)[:-3],
    b'{"v":2,"type":"metrics","job":"\xff","rank":0}',
    '{"v":2,"type":"metrics","job":"j","rank":0} trailing',
], ids=["valid", "nan", "-inf", "int-beyond-64-bits", "float-overflow", "deep", "duplicate-key",
        "lone-surrogate", "truncated", "bytes-escape", "trailing"])
def test_frames_decode_alike_with_and_without_orjson(raw: str | bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    # The backend parses frames with orjson (its extra); a hook-only install with the
    # standard library. Both must accept the same frames and word errors the same.
    import rebalancer_wire.protocol as protocol

    def outcome() -> object:
        try:
            return decode_versioned(raw)
        except ProtocolError as exc:
            return (type(exc), str(exc), exc.code, exc.close_code)

    assert protocol._fast_loads is not None, "the dev install carries orjson"
    fast = outcome()
    monkeypatch.setattr(protocol, "_fast_loads", None)
    assert outcome() == fast


def test_hello_carries_the_gpu_index_and_uuid() -> None:
    hello = Hello(job="j", rank=0, world_size=1, global_batch_size=8, gpu_index=3, gpu_uuid="GPU-x")
    back = decode(encode(hello))
    assert isinstance(back, Hello) and (back.gpu_index, back.gpu_uuid) == (3, "GPU-x")
    old = decode('{"type":"hello","v":1,"job":"j","rank":0,"world_size":1,"global_batch_size":8}')
    assert isinstance(old, Hello) and (old.gpu_index, old.gpu_uuid) == (None, "")
    with pytest.raises(ProtocolError, match="'gpu_index' must be between 0 and 4095, got 4096."):
        Hello.from_dict({"job": "j", "rank": 0, "world_size": 1, "global_batch_size": 8, "gpu_index": 4096})


def test_hello_carries_the_mesh_shape() -> None:
    mesh = MeshShape(dp=2, replica_size=4, dims=("dp", "tp"), shape=(2, 4))
    back = decode(encode(Hello(job="j", rank=1, world_size=2, global_batch_size=8, mesh=mesh)))
    assert isinstance(back, Hello) and back.mesh == mesh and back.mesh.label == "DP 2 x TP 4"
    plain = encode(Hello(job="j", rank=0, world_size=2, global_batch_size=8))
    assert '"mesh"' not in plain and decode(plain).mesh is None  # type: ignore[union-attr]
    assert '"mesh"' not in encode(Hello(job="j", rank=1, world_size=2, global_batch_size=8, mesh=mesh), 1)


MESH_OK = {"dp": 2, "replica_size": 2, "dims": ["dp", "tp"], "shape": [2, 2]}


@pytest.mark.parametrize(("mesh", "expected"), [
    (7, "'mesh' must be a JSON object, got int."),
    ({**MESH_OK, "dp": 4}, "'mesh.dp' (4) must equal 'world_size' (2): with a mesh the hook speaks for one "
                           "data-parallel replica, so world_size counts replicas."),
    ({**MESH_OK, "replica_size": 0}, "'mesh.replica_size' must be an integer between 1 and 65536, got 0."),
    ({**MESH_OK, "replica_size": True}, "'mesh.replica_size' must be an integer between 1 and 65536, got True."),
    ({**MESH_OK, "replica_size": 40000}, "'mesh.dp' x 'mesh.replica_size' (2 x 40000) must be at most 65536 ranks."),
    ({**MESH_OK, "dims": []}, "'mesh.dims' must be a list of 1 to 8 dimension names, got []."),
    ({**MESH_OK, "dims": ["dp", "t p"]}, "'mesh.dims' holds 't p'; a dimension name is 1 to 32 letters, digits or "
                                         "'_', not starting with a digit (e.g. 'dp', 'tp')."),
    ({**MESH_OK, "dims": ["dp", "dp"]}, "'mesh.dims' names a dimension twice: ['dp', 'dp']."),
    ({**MESH_OK, "shape": [2]}, "'mesh.shape' must be a list of 2 sizes (one per name in 'mesh.dims') between 1 "
                                "and 65536, got [2]."),
    ({**MESH_OK, "shape": [2, 3]}, "'mesh.shape' [2, 3] holds 6 ranks, but 'mesh.dp' x 'mesh.replica_size' is "
                                   "2 x 2 = 4."),
])
def test_a_bad_mesh_shape_is_named(mesh: object, expected: str) -> None:
    with pytest.raises(ProtocolError) as err:
        Hello.from_dict({"job": "j", "rank": 0, "world_size": 2, "global_batch_size": 8, "mesh": mesh})
    assert str(err.value) == expected


def test_hello_carries_each_members_device_in_the_order_of_its_ranks() -> None:
    mesh = MeshShape(dp=2, replica_size=2, dims=("dp", "tp"), shape=(2, 2))
    devices = ("node-a NVIDIA H100 80GB HBM3 #0", "node-a NVIDIA H100 80GB HBM3 #1")
    back = decode(encode(Hello(job="j", rank=0, world_size=2, global_batch_size=8, mesh=mesh, replica_ranks=(0, 1),
                               replica_devices=devices)))
    assert isinstance(back, Hello) and back.replica_devices == devices
    older = encode(Hello(job="j", rank=0, world_size=2, global_batch_size=8, mesh=mesh, replica_ranks=(0, 1)))
    assert "replica_devices" not in older and decode(older).replica_devices == ()  # type: ignore[union-attr]
    frame = {"job": "j", "rank": 0, "world_size": 2, "global_batch_size": 8, "mesh": MESH_OK, "replica_ranks": [0, 1]}
    for bad in (["only one"], ["a", 7], ["a", "x" * 129], ["a", "b\x00"], "node-a"):
        with pytest.raises(ProtocolError) as err:
            Hello.from_dict({**frame, "replica_devices": bad})
        assert str(err.value).startswith("'replica_devices' must list one string per member of 'replica_ranks' (2), "
                                         "in the same order, each at most 128 characters without NUL, got "), bad
    with pytest.raises(ProtocolError, match="'replica_devices' comes with 'replica_ranks' only"):
        Hello.from_dict({**frame, "replica_ranks": [], "replica_devices": ["a", "b"]})


def test_check_shares_says_what_is_wrong() -> None:
    assert check_shares([3, 0, 5], world_size=3, global_batch_size=8) == [3, 0, 5]
    with pytest.raises(ValueError, match="shares has 2 entries but the job has world_size 3."):
        check_shares([4, 4], world_size=3, global_batch_size=8)
    with pytest.raises(ValueError, match="shares sum to 7 but the global batch size is 8."):
        check_shares([3, 3, 1], world_size=3, global_batch_size=8)
    with pytest.raises(ValueError, match=r"shares\[1\] must be >= 0, got -1."):
        check_shares([5, -1, 4], world_size=3, global_batch_size=8)
    with pytest.raises(ValueError, match=r"shares\[0\] must be an integer, got 2.5."):
        check_shares([2.5, 2.5, 3], world_size=3, global_batch_size=8)


def test_uniform_shares_spread_the_remainder_over_the_lowest_ranks() -> None:
    assert uniform_shares(3, 8) == [3, 3, 2]
    assert sum(uniform_shares(7, 1000)) == 1000
    with pytest.raises(ValueError, match=r"global_batch_size \(2\) must be >= world_size \(3\)."):
        uniform_shares(3, 2)


def test_placement_carries_an_optional_cost_model_in_range() -> None:
    from rebalancer_wire.protocol import Placement

    plain = Placement(job="j", version=2, shares=[3, 5], global_batch_size=8)
    assert "length_sq_weight" not in encode(plain)  # absent at 0: an older hook reads the same
    assert decode(encode(plain)) == plain
    fitted = Placement(job="j", version=2, shares=[3, 5], global_batch_size=8, length_sq_weight=5e-4)
    assert decode(encode(fitted)) == fitted
    raw = json.loads(encode(fitted))
    with pytest.raises(ProtocolError) as err:
        decode(json.dumps({**raw, "length_sq_weight": -1}))
    assert str(err.value) == "'length_sq_weight' must be a number between 0 and 1000000, got -1.0."
    with_sq = StepRecord(**GOOD, work=10.0, batch_work=20.0, work_sq=50.0, batch_work_sq=200.0)
    assert StepRecord.from_dict(with_sq.to_dict()) == with_sq

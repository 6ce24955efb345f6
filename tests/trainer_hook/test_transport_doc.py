"""docs/protocol.md stays exact against rebalancer_wire/protocol.py."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from rebalancer_wire import protocol
from rebalancer_wire.node import NODE_FRAME_VERSION, NodeMetrics, decode_frame, encode_node
from rebalancer_wire.protocol import (
    Ack,
    DeviceSample,
    Error,
    Hello,
    Leave,
    Metrics,
    Oom,
    Placement,
    Reject,
    StepRecord,
    decode,
    decode_versioned,
    encode,
)

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
ALL_FRAMES = re.findall(r"```json\n(.*?)\n```", DOC, flags=re.S)
FRAMES = [f for f in ALL_FRAMES if '"type":"node_metrics"' not in f]  # per-rank messages
NODE_FRAMES = [f for f in ALL_FRAMES if '"type":"node_metrics"' in f]


def test_doc_has_an_example_of_every_message_kind() -> None:
    kinds = {type(decode(f)).TYPE for f in FRAMES}
    assert kinds == {"hello", "metrics", "ack", "reject", "oom", "leave", "placement", "error"}
    assert {decode_versioned(f)[1] for f in FRAMES} == set(protocol.SUPPORTED_VERSIONS)
    assert NODE_FRAMES, "docs/protocol.md shows a node_metrics frame"


@pytest.mark.parametrize("frame", FRAMES)
def test_every_example_frame_decodes_and_reencodes_identically(frame: str) -> None:
    msg, version = decode_versioned(frame)
    assert encode(msg, version) == frame


@pytest.mark.parametrize("frame", NODE_FRAMES)
def test_every_example_node_frame_decodes_and_reencodes_identically(frame: str) -> None:
    msg, version = decode_frame(frame)
    assert version == NODE_FRAME_VERSION and isinstance(msg, NodeMetrics) and encode_node(msg) == frame


@pytest.mark.parametrize("field", [f.name for f in fields(NodeMetrics)])
def test_every_node_frame_field_is_documented(field: str) -> None:
    assert f"| `{field}` |" in DOC


@pytest.mark.parametrize("cls", [Hello, Metrics, StepRecord, DeviceSample, Ack, Reject, Oom, Leave, Placement, Error])
def test_every_field_is_documented(cls: type) -> None:
    for f in fields(cls):
        assert f"| `{f.name}` |" in DOC, f"docs/protocol.md does not document {cls.__name__}.{f.name}"


def test_constants_match() -> None:
    assert f"version **{protocol.PROTOCOL_VERSION}**" in DOC
    assert f"{protocol.MAX_MESSAGE_BYTES:,} bytes" in DOC
    assert f"| {protocol.MAX_RECORDS_PER_MESSAGE} | `MAX_RECORDS_PER_MESSAGE`" in DOC
    assert f"| {protocol.MAX_WORLD_SIZE} | `MAX_WORLD_SIZE`" in DOC
    for name in ("CLOSE_NORMAL", "CLOSE_TOO_BIG", "CLOSE_UNSUPPORTED_VERSION", "CLOSE_MALFORMED",
                 "CLOSE_UNAUTHORIZED", "CLOSE_FORBIDDEN"):
        assert f"| {getattr(protocol, name)} | `{name}` |" in DOC, name

"""A job's dashboard feed copied between two hubs in process (what ``backend.cluster.fanout``
carries over Redis): the owner's snapshot, checked and merged by a watcher whose clients get
the same frames as the owner's; bad snapshots refused with the field named; the bounds."""

from __future__ import annotations

import asyncio
import json

import pytest

from backend.dashboard import remote
from tests.backend.test_hub import (
    FakeSocket,
    _feed,
    _hub,
    _register,
    _run_async,
    _services,
    _settle,
)


def _copy(owner, watcher, job: str = "j", *, replica: str = "a", seq: int) -> bool:
    owner.notify(job)  # what ingest does for each metrics frame
    owner.tick()
    _, text = owner.snapshot(job, replica=replica, seq=seq)
    return watcher.apply_remote(job, remote.check(job, text))


@_run_async
async def test_a_watcher_shows_the_owners_feed_as_full_frame_then_deltas():
    svc, empty = _services(), _services()
    _register(svc.live)
    owner, watcher = _hub(svc), _hub(empty, clock=lambda: 0.0)
    for b in range(10):
        _feed(svc.live, b)
    sock = FakeSocket()
    task = asyncio.create_task(watcher.attach(sock.send, "j"))
    await _settle()
    assert sock.frames[-1]["summary"] is None  # nothing of the job here yet
    assert _copy(owner, watcher, seq=1)
    watcher.tick()
    await _settle()
    first = sock.frames[-1]
    assert first["full"] is True and first["series"]["b"] == list(range(10))
    assert first["ranks"]["rank"] == [0, 1, 2] and first["summary"]["world_size"] == 3
    assert watcher.snapshot("j", replica="b", seq=1) is None  # a copy is never passed on
    for b in range(10, 15):
        _feed(svc.live, b)
    assert _copy(owner, watcher, seq=2)
    assert not _copy(owner, watcher, seq=2)  # the same sequence again: nothing to apply
    watcher.tick()
    await _settle()
    assert sock.frames[-1]["full"] is False and sock.frames[-1]["series"]["b"] == [10, 11, 12, 13, 14]
    assert watcher.savings("j") == owner.savings("j")
    # A new owner (failover) starts its own sequences: the client gets a full frame again.
    assert _copy(owner, watcher, replica="c", seq=1)
    watcher.tick()
    await _settle()
    assert sock.frames[-1]["full"] is True and sock.frames[-1]["series"]["b"] == list(range(15))
    # This replica took the job: the copy goes, the client starts over from local state.
    watcher.drop_remote("j")
    watcher.tick()
    await _settle()
    assert sock.frames[-1]["full"] is True and sock.frames[-1]["summary"] is None
    task.cancel()


def test_bad_snapshots_are_refused_with_the_field_named():
    svc = _services()
    _register(svc.live)
    owner = _hub(svc)
    _feed(svc.live, 0)
    owner.notify("j")
    owner.tick()
    _, text = owner.snapshot("j", replica="a", seq=1)
    good = json.loads(text)
    assert remote.check("j", text)["seq"] == 1
    cases = [
        ({**good, "job": "other"}, "snapshot.job must be 'j', got 'other'."),
        ({**good, "seq": -1}, "snapshot.seq must be an integer between 0 and 9007199254740992, got -1."),
        ({**good, "replica": ""}, "snapshot.replica must be a replica id of 1 to 64 characters."),
        ({**good, "series": [{"b": "x"}]}, "snapshot.series entries must be objects with an integer 'b'."),
        ({**good, "series": [{"b": 1}]}, "snapshot.series entries must have the fields b, step_ms"),
        ({**good, "series": [good["series"][0]] * 601}, "snapshot.series must be a list of at most 600 entries."),
        ({**good, "control": []}, "snapshot.control must be an object, got list."),
        ({**good, "saved_ms": -1.0}, "snapshot.saved_ms must be a finite number >= 0, got -1.0."),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match="^" + message.replace(".", r"\.").replace("(", r"\(")):
            remote.check("j", json.dumps(bad))
    with pytest.raises(ValueError, match="snapshot numbers must be finite, got NaN."):
        remote.check("j", text.replace('"saved_ms":0.0', '"saved_ms":NaN').replace('"saved_ms":0', '"saved_ms":NaN'))
    with pytest.raises(ValueError, match="snapshot must be a JSON object."):
        remote.check("j", "[1]")
    with pytest.raises(ValueError, match="is over"):
        remote.check("j", " " * (remote.MAX_SNAPSHOT_BYTES + 1))


def test_a_snapshot_over_the_limit_leaves_out_the_per_rank_columns(monkeypatch):
    svc = _services()
    _register(svc.live)
    owner = _hub(svc)
    for b in range(50):
        _feed(svc.live, b)
    owner.notify("j")
    owner.tick()
    _, text = owner.snapshot("j", replica="a", seq=1)
    full = json.loads(text)
    assert full["ranks"] is not None and len(full["series"]) == 50
    monkeypatch.setattr(remote, "MAX_SNAPSHOT_BYTES", len(text) - 1)
    _, text = owner.snapshot("j", replica="a", seq=2)
    assert json.loads(text)["ranks"] is None and json.loads(text)["heat"] == []
    monkeypatch.setattr(remote, "MAX_SNAPSHOT_BYTES", 100)
    assert owner.snapshot("j", replica="a", seq=3) == (owner.updated_at("j"), None)


def test_points_folded_here_and_not_stored_survive_a_copy_replacing_the_feed():
    # This replica folded the job (its ranks were here), then another replica took it.
    svc, other = _services(), _services()
    _register(svc.live)
    _register(other.live)
    here, owner = _hub(svc), _hub(other)
    for b in range(4):
        _feed(svc.live, b)
        _feed(other.live, b + 100)
    here.notify("j")
    here.tick()
    assert _copy(owner, here, seq=1)
    unsaved = here.take_unsaved()
    assert [(job, [p["b"] for p in points]) for job, points, _ in unsaved] == [("j", [0, 1, 2, 3])]
    assert here.take_unsaved() == []  # the copy itself is never stored here

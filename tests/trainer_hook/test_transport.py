"""Transport against a real websocket server started in the test on a free loopback port."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import timeit
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.sync.server import Server, ServerConnection, serve

from rebalancer_wire.protocol import (
    CLOSE_REDIRECT,
    MAX_MESSAGE_BYTES,
    MAX_RECORDS_PER_MESSAGE,
    Ack,
    DeviceSample,
    Error,
    Hello,
    Message,
    Metrics,
    Placement,
    Reject,
    StepRecord,
    decode,
    encode,
)
from tests.helpers.ports import free_port
from tests.helpers.waiting import Collect
from trainer_hook.transport import Transport, hook_ws_url, hook_ws_urls

WAIT_S = 20.0  # generous: the machine is shared; every wait ends early on success


class WsBackend:
    """A tiny real websocket server speaking the hook protocol, recording what arrives."""

    def __init__(self, port: int | None = None, *, close_on_hello: tuple[int, str] | None = None,
                 http_status: int | None = None, redirect_to: str | None = None) -> None:
        self.port = port or free_port()
        self.close_on_hello = close_on_hello
        self.redirect_to = redirect_to  # answer every hello like a replica that does not own the job
        self.http_status = http_status
        self.frames: list[tuple[int, Message]] = []  # (connection number, message)
        self.raw_sizes: list[int] = []
        self.headers: list[Headers] = []
        self.connections = 0
        self.cond = threading.Condition()
        self._server: Server | None = None
        self._thread: threading.Thread | None = None

    def _process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        with self.cond:
            self.headers.append(request.headers)
        if self.http_status is not None:
            return conn.respond(self.http_status, "Unauthorized.\n")
        return None

    def _handler(self, conn: ServerConnection) -> None:
        with self.cond:
            self.connections += 1
            n = self.connections
        try:
            for raw in conn:
                msg = decode(raw)
                with self.cond:
                    self.frames.append((n, msg))
                    self.raw_sizes.append(len(raw))
                    self.cond.notify_all()
                if isinstance(msg, Hello):
                    if self.redirect_to is not None:
                        conn.send(encode(Error(code="redirect", message=self.redirect_to)))
                        conn.close(CLOSE_REDIRECT, self.redirect_to)  # as the backend: the URL again
                        return
                    if self.close_on_hello is not None:
                        conn.close(*self.close_on_hello)
                        return
                    conn.send(encode(Placement(job=msg.job, version=msg.placement_version,
                                               shares=[msg.global_batch_size], global_batch_size=msg.global_batch_size)))
        except ConnectionClosed:
            pass

    def start(self) -> WsBackend:
        self._server = serve(self._handler, "127.0.0.1", self.port, process_request=self._process_request)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop like a crashed backend: stop listening and drop every open connection."""
        if self._server is None:
            return
        self._server.shutdown()
        for conn in list(self._server.connections):
            conn.close_socket()
        assert self._thread is not None
        self._thread.join(10)
        self._server = None

    def send_all(self, msg: Message | str) -> None:
        assert self._server is not None
        for conn in list(self._server.connections):
            conn.send(msg if isinstance(msg, str) else encode(msg))

    def wait(self, pred: Callable[[], bool], what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(pred, WAIT_S):
                raise AssertionError(f"timed out waiting for {what}; got {self.frames[-5:]}")

    def of(self, kind: type, conn: int | None = None) -> list[Any]:
        with self.cond:
            return [m for c, m in self.frames if isinstance(m, kind) and (conn is None or c == conn)]

    def steps(self) -> list[StepRecord]:
        return [s for m in self.of(Metrics) for s in m.steps]


@pytest.fixture
def backend() -> Iterator[WsBackend]:
    b = WsBackend().start()
    yield b
    b.stop()


def step(k: int) -> StepRecord:
    return StepRecord(batch_index=k, local_batch_size=8, placement_version=0, data_wait_ms=0.1,
                      compute_ms=12.5, sync_wait_ms=1.0, optimizer_ms=0.5, step_ms=14.0, t=1.7e9 + k)


def sample(t: float) -> DeviceSample:
    return DeviceSample(t=t, source="psutil", cpu_pct=50.0, rss_bytes=10**8)


class HookState:
    """What the hook core would supply: hello() reports its current batch index."""

    def __init__(self) -> None:
        self.batch_index = 0
        self.hellos = 0
        self.received: list[Message] = []
        self.got = threading.Event()

    def hello(self) -> Hello:
        self.hellos += 1
        return Hello(job="j1", rank=1, world_size=2, global_batch_size=16, batch_index=self.batch_index,
                     placement_version=3, device_type="CPU")

    def on_message(self, msg: Message) -> None:
        self.received.append(msg)
        self.got.set()


def make(port: int, state: HookState, **kw: Any) -> Transport:
    kw.setdefault("backoff_initial_s", 0.05)
    kw.setdefault("backoff_max_s", 0.2)
    kw.setdefault("flush_interval_s", 0.05)
    return Transport(url=f"http://127.0.0.1:{port}", token=kw.pop("token", None), hello=state.hello,
                     on_message=state.on_message, **kw)


def test_hello_first_then_batches_in_order(backend: WsBackend) -> None:
    state = HookState()
    t = make(backend.port, state, token="s3cret")
    n = 5000
    for k in range(n):  # queued before the connection exists
        t.put_step(step(k))
    t.put_device(sample(1.0))
    t.start()
    try:
        backend.wait(lambda: len(backend.steps()) == n, "all steps")
        assert t.connected
        first = backend.frames[0][1]
        assert isinstance(first, Hello) and first.job == "j1" and first.rank == 1
        assert backend.headers[0]["Authorization"] == "Bearer s3cret"
        metrics = backend.of(Metrics)
        assert len(metrics) >= 3  # 5000 records need at least ceil(5000 / 2048) frames
        assert all(len(m.steps) <= MAX_RECORDS_PER_MESSAGE and m.job == "j1" and m.rank == 1 for m in metrics)
        assert max(backend.raw_sizes) <= MAX_MESSAGE_BYTES
        assert [s.batch_index for s in backend.steps()] == list(range(n))
        assert backend.steps()[7] == step(7)
        assert [d for m in metrics for d in m.device] == [sample(1.0)]
        assert sum(m.dropped for m in metrics) == 0 and t.dropped == 0
        # The reply to hello reaches on_message.
        assert state.got.wait(WAIT_S)
        assert isinstance(state.received[0], Placement) and state.received[0].version == 3
        # Records put later go out in later batches, still in order.
        for k in range(n, n + 50):
            t.put_step(step(k))
        backend.wait(lambda: len(backend.steps()) == n + 50, "later steps")
        assert [s.batch_index for s in backend.steps()] == list(range(n + 50))
    finally:
        t.close()
    assert not t.connected


def test_reconnect_resends_hello_and_reports_drops() -> None:
    port = free_port()
    b1 = WsBackend(port).start()
    state = HookState()
    t = make(port, state, max_queue=100)
    t.start()
    try:
        t.put_step(step(0))
        b1.wait(lambda: len(b1.steps()) == 1, "the first step")
        b1.stop()
        # Wait until the transport notices, then overflow its buffer while the backend is down.
        deadline = time.monotonic() + WAIT_S
        while t.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not t.connected
        state.batch_index = 250
        for k in range(1, 251):
            t.put_step(step(k))
        assert t.dropped == 150  # 250 records into 100 slots
        b2 = WsBackend(port).start()
        try:
            b2.wait(lambda: len(b2.steps()) == 100, "the buffered steps")
            hello = b2.frames[0][1]
            assert isinstance(hello, Hello) and hello.batch_index == 250  # fresh hello, current state
            assert state.hellos == 2
            # The newest records survive, in order; the drop count arrives with them.
            assert [s.batch_index for s in b2.steps()] == list(range(151, 251))
            assert sum(m.dropped for m in b2.of(Metrics)) == 150
            assert b2.of(Metrics)[0].dropped == 150
            t.put_step(step(251))
            b2.wait(lambda: len(b2.steps()) == 101, "a step after reconnect")
            assert sum(m.dropped for m in b2.of(Metrics)) == 150  # reported once, not again
        finally:
            t.close()
            b2.stop()
    finally:
        b1.stop()


def test_put_step_is_cheap_and_bounded_with_no_server() -> None:
    state = HookState()
    t = make(free_port(), state, max_queue=1000)  # nothing listens on this port
    t.start()
    try:
        rec = step(1)
        plain: collections.deque[StepRecord] = collections.deque(maxlen=1000)
        q: queue.Queue[StepRecord] = queue.Queue(maxsize=1000)

        def queue_put() -> None:
            try:
                q.put_nowait(rec)
            except queue.Full:
                pass

        n = 20000
        # Interleave and take the best of several runs so both see the same machine load.
        best = {"put_step": 1e9, "deque": 1e9, "queue": 1e9}
        for _ in range(7):
            best["put_step"] = min(best["put_step"], timeit.timeit(lambda: t.put_step(rec), number=n))
            best["deque"] = min(best["deque"], timeit.timeit(lambda: plain.append(rec), number=n))
            best["queue"] = min(best["queue"], timeit.timeit(queue_put, number=n))
        # put_step is a length check plus a deque append: a small multiple of a bare append,
        # and cheaper than queue.Queue.put_nowait (which takes a lock and a condition).
        assert best["put_step"] < 6 * best["deque"], best
        assert best["put_step"] < best["queue"], best
        assert not t.connected
        # Memory stays bounded whatever is put: the queue never grows beyond max_queue.
        assert len(t._steps) == 1000
        assert t.dropped == 7 * n - 1000
    finally:
        t.close(timeout=0.5)


def test_control_messages_are_sent_and_survive_overflow(backend: WsBackend) -> None:
    state = HookState()
    t = make(backend.port, state, max_queue=10)
    t.send_control(Ack(job="j1", rank=1, version=4, batch_index=40))
    for k in range(30):
        t.put_step(step(k))
    t.send_control(Reject(job="j1", rank=1, version=5, reason="shares sum to 15 but the global batch size is 16."))
    t.start()
    try:
        backend.wait(lambda: len(backend.of(Reject)) == 1 and len(backend.steps()) == 10, "control and steps")
        kinds = [type(m).__name__ for _, m in backend.frames]
        assert kinds[:3] == ["Hello", "Ack", "Reject"]  # control goes before metrics
        assert backend.of(Ack)[0].batch_index == 40
        assert sum(m.dropped for m in backend.of(Metrics)) == 20
    finally:
        t.close()


def test_close_flushes_everything_queued(backend: WsBackend) -> None:
    state = HookState()
    t = make(backend.port, state, flush_interval_s=30.0)  # no periodic flush: close() must do it
    t.start()
    backend.wait(lambda: len(backend.of(Hello)) == 1, "hello")
    for k in range(3000):
        t.put_step(step(k))
    t.send_control(Ack(job="j1", rank=1, version=1, batch_index=3))
    t.close(timeout=10)
    backend.wait(lambda: len(backend.steps()) == 3000 and len(backend.of(Ack)) == 1, "flushed records")
    assert [s.batch_index for s in backend.steps()] == list(range(3000))


def test_on_message_errors_are_contained(backend: WsBackend, caplog: pytest.LogCaptureFixture) -> None:
    got = Collect(3)

    def on_message(msg: Message) -> None:
        got(msg)
        raise RuntimeError("hook bug")

    state = HookState()
    t = Transport(url=f"ws://127.0.0.1:{backend.port}/", token=None, hello=state.hello, on_message=on_message,
                  flush_interval_s=0.05)
    t.start()
    try:
        backend.wait(lambda: len(backend.of(Hello)) == 1, "hello")
        deadline = time.monotonic() + WAIT_S
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        backend.send_all('{"type":"placement","v":1,"job":"j1"}')  # malformed: ignored, logged
        backend.send_all(Metrics(job="j1", rank=0))  # not a backend->hook message: ignored
        backend.send_all(Placement(job="j1", version=9, shares=[8, 8], global_batch_size=16))
        backend.send_all(Error(code="malformed", message="'rank' is required."))
        assert got.enough.wait(WAIT_S)
        assert [type(m).__name__ for m in got] == ["Placement", "Placement", "Error"]
        assert got[1].version == 9  # type: ignore[union-attr]
        t.put_step(step(0))
        backend.wait(lambda: len(backend.steps()) == 1, "a step after callback errors")
        assert t.connected
    finally:
        t.close()
    text = caplog.text
    assert "on_message raised" in text and "Ignoring a malformed frame" in text
    assert "Ignoring an unexpected 'metrics' frame" in text


def test_unsupported_version_close_stops_the_transport(caplog: pytest.LogCaptureFixture) -> None:
    b = WsBackend(close_on_hello=(4001, "Protocol version 2 is not supported")).start()
    state = HookState()
    t = make(b.port, state)
    t.start()
    try:
        assert t._thread is not None
        t._thread.join(WAIT_S)
        assert not t._thread.is_alive()  # stopped for good, no retry loop
        assert b.connections == 1
        assert "does not speak this hook's protocol version" in caplog.text
        t.put_step(step(0))  # still safe to call
    finally:
        t.close()
        b.stop()


@pytest.mark.parametrize("how", ["close_4401", "close_4403", "http_401"])
def test_auth_refusal_backs_off_long(how: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="trainer_hook.transport")
    if how == "http_401":
        b = WsBackend(http_status=401).start()
    else:
        b = WsBackend(close_on_hello=(int(how[-4:]), "Invalid token.")).start()
    state = HookState()
    t = make(b.port, state, token="wrong", backoff_initial_s=0.01, backoff_max_s=0.01, auth_backoff_s=600.0)
    t.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while "refused this hook's token" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "refused this hook's token" in caplog.text and "REBALANCER_TOKEN" in caplog.text
        # With the normal 10 ms backoff it would reconnect dozens of times in this window.
        time.sleep(0.3)
        assert len(b.headers) == 1
    finally:
        t.close()  # interrupts the long back-off at once
        b.stop()
    assert t._thread is not None and not t._thread.is_alive()


def test_server_going_away_and_coming_back_repeatedly() -> None:
    port = free_port()
    state = HookState()
    t = make(port, state)
    t.start()
    try:
        sent = 0
        for round_ in range(3):
            b = WsBackend(port).start()
            try:
                t.put_step(step(sent))
                sent += 1
                b.wait(lambda b=b: len(b.steps()) >= 1, f"a step in round {round_}")  # type: ignore[misc]
                assert isinstance(b.frames[0][1], Hello)
            finally:
                b.stop()
        assert state.hellos >= 3
    finally:
        t.close(timeout=0.5)


def test_a_redirect_is_followed_to_the_owner() -> None:
    owner = WsBackend().start()
    other = WsBackend(redirect_to=f"http://127.0.0.1:{owner.port}").start()
    state = HookState()
    t = make(other.port, state)
    t.put_step(step(0))
    t.send_control(Ack(job="j1", rank=1, version=3, batch_index=0))
    t.start()
    try:
        # What went out before the redirect reached the non-owner, which reads no further
        # than the hello: the owner gets it again.
        owner.wait(lambda: len(owner.steps()) == 1 and len(owner.of(Ack)) == 1, "the step and the ack at the owner")
        assert other.connections == 1 and not other.steps()  # the non-owner got the hello only
        assert t.url == f"ws://127.0.0.1:{owner.port}/ws/hook"
    finally:
        t.close(timeout=0.5)
        owner.stop()
        other.stop()


def test_a_bad_redirect_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    other = WsBackend(redirect_to="ftp://evil.example").start()
    state = HookState()
    t = make(other.port, state)
    t.start()
    try:
        other.wait(lambda: other.connections >= 2, "a retry at the same backend")
        assert "Ignoring a redirect from" in caplog.text and "'ftp://evil.example'" in caplog.text
    finally:
        t.close(timeout=0.5)
        other.stop()


def test_several_servers_the_next_when_one_is_down_and_back_from_a_dead_owner() -> None:
    dead_owner = f"http://127.0.0.1:{free_port()}"
    replica = WsBackend(redirect_to=dead_owner).start()
    state = HookState()
    # The first server is unreachable; the second sends the rank to an owner that is gone.
    t = Transport(url=f"http://127.0.0.1:{free_port()},http://127.0.0.1:{replica.port}",
                  token=None, hello=state.hello, on_message=state.on_message, backoff_initial_s=0.05,
                  backoff_max_s=0.2, flush_interval_s=0.05)
    t.start()
    try:
        t.put_step(step(0))
        # The transport comes back from the dead owner to its list: a second hello here.
        replica.wait(lambda: replica.connections >= 2, "the rank back at the replica")
        replica.redirect_to = None  # the owner's lease expired: this replica takes the job
        replica.wait(lambda: len(replica.steps()) == 1, "the step at the replica that took the job")
    finally:
        t.close(timeout=0.5)
        replica.stop()
    assert hook_ws_urls("http://a:1, https://b") == ["ws://a:1/ws/hook", "wss://b/ws/hook"]
    with pytest.raises(ValueError, match="scheme http, https, ws or wss and a host"):
        hook_ws_urls("http://a:1,b:2")


@pytest.mark.parametrize(
    ("given", "ws"),
    [
        ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/ws/hook"),
        ("http://127.0.0.1:8000/", "ws://127.0.0.1:8000/ws/hook"),
        ("https://rb.example.com", "wss://rb.example.com/ws/hook"),
        ("https://proxy.example.com/rebalancer/", "wss://proxy.example.com/rebalancer/ws/hook"),
        ("ws://10.0.0.1:9000/ws/hook", "ws://10.0.0.1:9000/ws/hook"),
        ("wss://h:1", "wss://h:1/ws/hook"),
    ],
)
def test_hook_ws_url(given: str, ws: str) -> None:
    assert hook_ws_url(given) == ws


@pytest.mark.parametrize("bad", ["127.0.0.1:8000", "ftp://h", "http://", "", "  "])
def test_bad_url_is_a_clear_error(bad: str) -> None:
    with pytest.raises(ValueError) as exc:
        Transport(url=bad, token=None, hello=HookState().hello, on_message=lambda m: None)
    assert str(exc.value).startswith("server must be a URL like 'http://127.0.0.1:8000'")
    assert repr(bad) in str(exc.value)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"max_queue": 0}, "max_queue must be an integer >= 1, got 0."),
        ({"flush_interval_s": 0}, "flush_interval_s must be a number > 0, got 0."),
        ({"eager_steps": -1}, "eager_steps must be an integer >= 0, got -1."),
        ({"flush_on_deviation": -0.1},
         "flush_on_deviation must be a number between 0 and 10 (0: off), got -0.1."),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], text: str) -> None:
    with pytest.raises(ValueError) as exc:
        Transport(url="http://h:1", token=None, hello=HookState().hello, on_message=lambda m: None, **kwargs)
    assert str(exc.value) == text


def test_frames_that_would_exceed_the_size_limit_are_split(backend: WsBackend) -> None:
    state = HookState()
    t = make(backend.port, state)
    n_steps, n_dev = 3000, 600
    for k in range(n_steps):
        t.put_step(StepRecord(batch_index=k, local_batch_size=123456, placement_version=98765,
                              data_wait_ms=1 / 3, compute_ms=1e6 / 7, sync_wait_ms=2 / 3, optimizer_ms=1 / 7,
                              step_ms=1e6 / 3, t=1.7e9 + k / 7))
    fat_reasons = [f"reason_{i}_".ljust(64, "x") for i in range(32)]  # the largest sample allowed
    for i in range(n_dev):
        t.put_device(DeviceSample(t=float(i), source="nvml", throttle_reasons=fat_reasons, util_pct=1 / 3))
    t.start()
    try:
        backend.wait(lambda: len(backend.steps()) == n_steps
                     and sum(len(m.device) for m in backend.of(Metrics)) == n_dev, "every record")
        assert max(backend.raw_sizes) <= MAX_MESSAGE_BYTES
        assert max(backend.raw_sizes) > MAX_MESSAGE_BYTES // 4  # frames are big, not one record each
        assert [s.batch_index for s in backend.steps()] == list(range(n_steps))
        assert [d.t for m in backend.of(Metrics) for d in m.device] == [float(i) for i in range(n_dev)]
        assert t.dropped == 0
    finally:
        t.close()


def test_malformed_close_reconnects_with_backoff() -> None:
    b = WsBackend(close_on_hello=(4002, "The first message must be 'hello'.")).start()
    state = HookState()
    t = make(b.port, state)
    t.start()
    try:
        b.wait(lambda: b.connections >= 3, "reconnects after close 4002")
        assert all(isinstance(m, Hello) for _, m in b.frames)  # hello first on each connection
    finally:
        t.close()
        b.stop()


def test_hello_that_raises_is_contained(backend: WsBackend, caplog: pytest.LogCaptureFixture) -> None:
    calls = {"n": 0}
    state = HookState()

    def flaky_hello() -> Hello:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("probe not ready")
        return state.hello()

    t = Transport(url=f"http://127.0.0.1:{backend.port}", token=None, hello=flaky_hello,
                  on_message=state.on_message, backoff_initial_s=0.05, flush_interval_s=0.05)
    t.start()
    try:
        t.put_step(step(0))
        backend.wait(lambda: len(backend.steps()) == 1, "a step after hello recovered")
        assert calls["n"] == 2 and "hello() raised" in caplog.text
    finally:
        t.close()


def test_close_returns_when_the_backend_never_answers_the_handshake() -> None:
    # A listener that accepts TCP connections but never speaks (a hung backend).
    import socket

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    try:
        state = HookState()
        t = make(lsock.getsockname()[1], state, open_timeout_s=3.0)
        t.start()
        for k in range(100):
            t.put_step(step(k))
        assert not t.connected
        t.close(timeout=0.2)  # must come back although the thread is stuck in the handshake
        assert not t.connected
    finally:
        lsock.close()


def test_a_step_that_deviates_from_the_recent_median_goes_out_at_once_marked_urgent(
        backend: WsBackend) -> None:
    # Interval and step count too large to fire: only the deviation sends the frame.
    state = HookState()
    t = make(backend.port, state, flush_interval_s=30.0, flush_steps=10_000, eager_steps=0)
    t.start()
    try:
        backend.wait(lambda: bool(backend.of(Hello)), "hello")
        for k in range(10):
            t.put_step(step(k))
        slow = dataclasses.replace(step(10), compute_ms=2 * step(10).compute_ms)
        t.put_step(slow)
        backend.wait(lambda: bool(backend.of(Metrics)), "the urgent frame")
        first = backend.of(Metrics)[0]
        assert first.urgent is True
        assert [s.batch_index for s in first.steps] == list(range(11))
    finally:
        t.close()
    # Off the wire, urgent is absent unless set (older backends never see it).
    assert '"urgent"' not in encode(Metrics(job="j", rank=0, steps=[step(0)]))


def test_the_first_steps_go_out_one_by_one(backend: WsBackend) -> None:
    state = HookState()
    t = make(backend.port, state, flush_interval_s=30.0, flush_steps=10_000, eager_steps=3)
    t.start()
    try:
        backend.wait(lambda: bool(backend.of(Hello)), "hello")
        t.put_step(step(0))
        backend.wait(lambda: len(backend.steps()) == 1, "step 0 alone")
        assert not backend.of(Metrics)[0].urgent
    finally:
        t.close()


class FrozenBackend:
    """A backend that answers the hello, then freezes like a paused process: its socket stays
    open and takes frames (the kernel buffers them), nothing reads them or answers a ping."""

    def __init__(self) -> None:
        import socket

        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._conns: list[Any] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import base64
        import hashlib

        with contextlib.suppress(OSError):
            conn, _ = self._listener.accept()
            self._conns.append(conn)
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(4096)
            key = next(line.split(b":", 1)[1].strip() for line in request.split(b"\r\n")
                       if line.lower().startswith(b"sec-websocket-key:"))
            accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
            conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
            placement = encode(Placement(job="j1", version=3, shares=[8, 8], global_batch_size=16)).encode()
            conn.sendall(bytes([0x81, len(placement)]) + placement)  # one unmasked text frame (< 126 bytes)

    def stop(self) -> None:
        for sock in (*self._conns, self._listener):
            sock.close()


def test_a_silent_backend_is_left_and_what_it_never_confirmed_is_sent_again() -> None:
    """A paused owner's socket takes frames nobody reads: after ``silent_timeout_s`` without a
    pong the transport goes to the next URL and sends again every frame not confirmed."""
    frozen, live = FrozenBackend(), WsBackend().start()
    state = HookState()
    t = Transport(url=f"http://127.0.0.1:{frozen.port},http://127.0.0.1:{live.port}", token=None,
                  hello=state.hello, on_message=state.on_message, flush_interval_s=0.05,
                  backoff_initial_s=0.05, backoff_max_s=0.2, silent_timeout_s=1.0)
    t.start()
    try:
        wait = time.monotonic() + WAIT_S
        while not state.received and time.monotonic() < wait:
            time.sleep(0.01)
        assert state.received, "the frozen backend's placement never arrived"
        for k in range(40):  # sent into the frozen backend's socket
            t.put_step(step(k))
            time.sleep(0.01)
        live.wait(lambda: [s.batch_index for s in live.steps()] == list(range(40)),
                  "every step at the next backend, once and in order")
    finally:
        t.close(timeout=0.5)
        live.stop()
        frozen.stop()

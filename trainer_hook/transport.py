"""Websocket client that streams a rank's metrics to the backend off the training thread.

The training thread only appends to bounded deques (a few tens of nanoseconds; a
``queue.Queue.put_nowait`` costs about 15x more because of its lock and condition). One
daemon thread owns the websocket: it connects, sends ``hello``, batches what the queues
hold into ``metrics`` frames every flush interval, sends acks and rejects, and hands the
backend's ``placement`` and ``error`` frames to a callback. With the backend down it
retries with exponential backoff capped at 1.5 s, jittered (so a recovered backend sees
every rank back within 2 s); the queues keep the newest records
and count what they had to drop, and the count goes out in the next ``metrics`` frame.

Several backend replicas (docs/scale-out.md): ``url`` may list several, comma-separated; a
failed connect moves on to the next. A replica that does not control the job answers the
hello with a redirect (an ``error`` with code ``redirect`` and close 4307) naming the one
that does; the transport checks that URL and reconnects there at once, and goes back to its
own list when it cannot reach it (the owner died: another replica takes the job).
See docs/protocol.md for the conversation.

One module, over 400 lines on purpose: the websocket's one owner thread and all it does
(connect, hello, batch, send, follow redirects, reconnect with the queued records); split,
its state would be shared between threads."""

from __future__ import annotations

import logging
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import islice
from typing import Any, Protocol

from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI
from websockets.sync.client import ClientConnection, connect

from rebalancer_wire.protocol import (
    CLOSE_FORBIDDEN,
    CLOSE_MALFORMED,
    CLOSE_REDIRECT,
    CLOSE_UNAUTHORIZED,
    CLOSE_UNSUPPORTED_VERSION,
    MAX_MESSAGE_BYTES,
    MAX_RECORDS_PER_MESSAGE,
    Ack,
    DeviceSample,
    Error,
    Hang,
    Hello,
    Message,
    Metrics,
    Oom,
    Placement,
    ProtocolError,
    Reject,
    StepRecord,
    decode,
    encode,
)
from trainer_hook._agent_trust import AgentRefused, connect_agent
from trainer_hook._confirm import Silent, Unconfirmed
from trainer_hook._route import Route
from trainer_hook._urls import UNIX, hook_ws_url, hook_ws_urls

__all__ = ["Relay", "Transport", "hook_ws_url", "hook_ws_urls"]

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how long one recv waits; bounds the latency of acks and of close()
_AUTH_CODES = (CLOSE_UNAUTHORIZED, CLOSE_FORBIDDEN)
_MAX_DEVICE_PER_MESSAGE = 256  # ~1 Hz samples; keeps a full frame of steps well under 1 MiB
_MAX_CONTROL = 4096  # acks/rejects are a few per placement; this only guards a runaway caller
_MAX_REDIRECTS = 3  # redirects followed in a row at once; then with back-off (a loop between replicas)
_MAX_UNANSWERED = 256  # metrics frames kept for resending until the hello is answered


class Relay(Protocol):
    """Other ranks' frames carried on this transport's connection (a node agent,
    trainer_hook/node_agg.py). Called on the transport thread only (but ``stop``)."""

    def hellos(self) -> list[str]:
        """The hellos to send after this rank's own on every (re)connect."""

    def peek(self) -> str | None:
        """The oldest frame waiting to go upstream, left in place until ``pop``."""

    def pop(self) -> None:
        """The frame ``peek`` gave was sent."""

    def carry(self, frame: str) -> bool:
        """This rank's own metrics frame, for the relay's next node frame (False: send it yourself)."""

    def unpack(self) -> bool:
        """The backend refused a node frame's version: per-rank frames from now on, the refused
        ones again (False: the relay sent no node frame it could take back)."""

    def deliver(self, raw: str) -> None:
        """A ``placement`` or ``error`` frame from the backend, for the other ranks."""

    def drop(self, rank: int, code: str, message: str) -> None:
        """The backend refused a frame of ``rank`` (another local rank) and dropped it alone."""

    def stop(self, reason: str) -> None:
        """Stop relaying: the other ranks go to their own connections."""

    def close(self) -> None:
        """This rank is closing: let the other ranks finish first (briefly), then stop."""


class _Stop(Exception):
    """The backend told us to stop for good (unsupported protocol version)."""


class Transport:
    """Streams step records and device samples of one rank to the backend.

    Example::

        t = Transport(url="http://127.0.0.1:8000", token=None, hello=make_hello,
                      on_message=handle)
        t.start()
        t.put_step(record)          # from the training thread: never blocks
        t.send_control(Ack(...))    # kept apart from metrics, never dropped by overflow
        t.close()                   # flushes for at most 2 s

    ``hello()`` is called on every (re)connect, so it should report the current placement
    version and batch index. ``on_message`` runs on the transport thread for every
    ``placement`` and ``error`` frame; exceptions it raises are logged, not propagated.
    """

    def __init__(
        self,
        *,
        url: str,
        token: str | None,
        hello: Callable[[], Hello],
        on_message: Callable[[Message], None],
        max_queue: int = 10000,
        flush_interval_s: float = 0.5,
        flush_steps: int = 5,
        flush_on_deviation: float = 0.2,
        eager_steps: int = 20,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 1.5,
        auth_backoff_s: float = 60.0,
        open_timeout_s: float = 5.0,
        local_agent: str | None = None,
        local_agent_wait_s: float = 10.0,
        relay: Relay | None = None,
        silent_timeout_s: float = 6.0,
    ) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an integer >= 1, got {max_queue!r}.")
        if isinstance(flush_steps, bool) or not isinstance(flush_steps, int) or flush_steps < 1:
            raise ValueError(f"flush_steps must be an integer >= 1, got {flush_steps!r}.")
        if isinstance(eager_steps, bool) or not isinstance(eager_steps, int) or eager_steps < 0:
            raise ValueError(f"eager_steps must be an integer >= 0, got {eager_steps!r}.")
        if isinstance(flush_on_deviation, bool) or not isinstance(flush_on_deviation, (int, float)) \
                or not 0 <= flush_on_deviation <= 10:
            raise ValueError(f"flush_on_deviation must be a number between 0 and 10 (0: off), got "
                             f"{flush_on_deviation!r}.")
        for name, val in (
            ("flush_interval_s", flush_interval_s),
            ("backoff_initial_s", backoff_initial_s),
            ("backoff_max_s", backoff_max_s),
            ("auth_backoff_s", auth_backoff_s),
            ("open_timeout_s", open_timeout_s),
            ("silent_timeout_s", silent_timeout_s),
        ):
            if not isinstance(val, (int, float)) or not val > 0:
                raise ValueError(f"{name} must be a number > 0, got {val!r}.")
        # A node agent's unix socket (another local rank carries this rank's frames) is
        # tried first; once it cannot be reached, this rank uses its own connection.
        self.route = Route(hook_ws_urls(url), agent=local_agent, agent_wait_s=local_agent_wait_s)
        self.relay = relay
        # Metrics frames sent on this connection before the backend answered the hello: a
        # replica that redirects reads nothing after the hello, so they are sent again to
        # the owner. Once a placement arrives the backend is reading: they are dropped.
        self._answered = False
        self._unanswered: list[str] = []
        self._unanswered_control: list[Ack | Reject | Oom | Hello] = []
        # Frames no pong confirmed: sent again after a break or a silence (``_confirm.py``).
        self._unconfirmed = Unconfirmed(float(silent_timeout_s))
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._hello = hello
        self._on_message = on_message
        self._max_queue = max_queue
        self._flush_s = float(flush_interval_s)
        # A frame goes out every flush interval, or sooner once this many steps wait: the
        # backend pays per frame, so frames carry several steps, yet fast jobs stay live.
        self._flush_steps = flush_steps
        # A step whose time per sample is this far off the median of the last few goes out
        # at once, marked urgent (the backend runs the policy on it without pacing): a
        # slowdown reaches the policy within a step, not a frame interval later. The first
        # ``eager_steps`` go out one by one, so the policy's warm-up is not held back.
        self._deviation = float(flush_on_deviation)
        self._eager_steps = eager_steps
        self._per_sample: deque[float] = deque(maxlen=8)
        self._scanned = 0  # records at the front of _steps already looked at
        self._urgent = False
        self._backoff0 = float(backoff_initial_s)
        self._backoff_max = float(backoff_max_s)
        self._auth_backoff = float(auth_backoff_s)
        self._open_timeout = float(open_timeout_s)
        self._steps: deque[StepRecord] = deque(maxlen=max_queue)
        # Device samples arrive at ~1 Hz; a smaller buffer still covers many minutes offline.
        self._devices: deque[DeviceSample] = deque(maxlen=max(16, min(max_queue, 3600)))
        self._control: deque[Ack | Reject | Oom | Hello] = deque()
        # Single-writer counters, so no lock on the hot path: producers bump *_dropped,
        # the sender thread bumps _reported; the difference is what is not yet reported.
        self._steps_dropped = 0
        self._devices_dropped = 0
        self._requeue_dropped = 0
        self._reported = 0
        self._close_deadline = 0.0
        self._unsent: list[str] = []  # frames built but not yet sent (resent after reconnect)
        self._ident: tuple[str, int] | None = None  # (job, rank) from the last hello
        self._hang: Hang | None = None  # a stall report waiting for the next frame
        self._ws: ClientConnection | None = None
        self._connected = False
        self._closing = threading.Event()
        self._stopped = False  # the backend refused our protocol version
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards start/close only
        self.connects = 0  # successful connections so far (diagnostics and tests)
        self.total_steps: int | None = None  # sent with every metrics frame (the job's ETA)

    # --- training-thread side ------------------------------------------------------------

    @property
    def url(self) -> str:
        """The URL of the current (or last) connection attempt."""
        return self.route.url

    @property
    def urls(self) -> list[str]:
        return self.route.urls

    @property
    def connected(self) -> bool:
        """True while a websocket is open and ``hello`` has been sent on it."""
        return self._connected

    @property
    def dropped(self) -> int:
        """Records (steps and device samples) dropped so far because the buffer was full."""
        return self._steps_dropped + self._devices_dropped + self._requeue_dropped

    def put_step(self, rec: StepRecord) -> None:
        """Queue one step record. Never blocks; when full, the oldest record is dropped."""
        q = self._steps
        if len(q) >= self._max_queue:
            self._steps_dropped += 1
        q.append(rec)

    def put_hang(self, hang: Hang) -> None:
        """A stall report (the watchdog's thread): it goes with the next metrics frame; a
        newer one replaces one not sent yet."""
        self._hang = hang

    def put_device(self, sample: DeviceSample) -> None:
        """Queue one device sample (from the probe thread). Never blocks."""
        q = self._devices
        if len(q) >= (q.maxlen or 0):
            self._devices_dropped += 1
        q.append(sample)

    def send_control(self, msg: Ack | Reject | Oom | Hello) -> None:
        """Queue an ack, reject or oom (or a hello that says more than the one sent on
        connecting); sent before any pending metrics, survives reconnects."""
        if not isinstance(msg, (Ack, Reject, Oom, Hello)):
            log.error("send_control expects an Ack, Reject, Oom or Hello, got %s; ignored.", type(msg).__name__)
            return
        if len(self._control) >= _MAX_CONTROL:
            log.error("More than %d acks/rejects are waiting to be sent; dropping the oldest.", _MAX_CONTROL)
            self._control.popleft()
        self._control.append(msg)

    def flush_control(self, timeout: float) -> bool:
        """Wait until every queued ack, reject or oom has been sent (True), or ``timeout``
        seconds passed (False). For a dying process: the sender thread does the sending."""
        deadline = time.monotonic() + max(0.0, timeout)
        while self._control:
            if time.monotonic() >= deadline or self._stopped or self._thread is None:
                return False
            time.sleep(0.005)
        return True

    def start(self) -> None:
        """Start the sender thread (idempotent)."""
        with self._lock:
            if self._thread is not None or self._closing.is_set():
                return
            self._thread = threading.Thread(target=self._run, name="rebalancer-transport", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Flush what can be sent within ``timeout`` seconds, then close the websocket."""
        if self.relay is not None:  # the other ranks' last frames and leaves go out in the flush
            self.relay.close()
        with self._lock:
            self._close_deadline = time.monotonic() + max(0.0, timeout)
            self._closing.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, timeout) + 0.5)
            if thread.is_alive():
                log.warning("Transport did not finish flushing within %.1fs; giving up.", timeout)
                ws = self._ws
                if ws is not None:
                    ws.close_socket()

    def after_fork_in_child(self) -> None:
        """A forked child: the sender thread is gone; close only this process's copies of the
        socket and of websockets' shutdown socketpair. Never ``close_socket()`` or a close
        frame: those shut down the parent's connection or wake its reader."""
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._closing.set()
        self._thread = None
        self._connected = False
        ws, self._ws = self._ws, None
        if ws is not None:
            for sock in (getattr(ws, "socket", None), getattr(ws, "shutdown_notifier", None)):
                if sock is not None:
                    try:
                        sock.close()  # close(2) of the child's descriptor; no shutdown(2)
                    except OSError:
                        pass

    # --- sender thread ---------------------------------------------------------------------

    def _run(self) -> None:
        delay = self._backoff0
        failures = 0
        while not self._closing.is_set():
            connects_before = self.connects
            self.route.pick()
            try:
                self._session()
                delay, failures = self._backoff0, 0
                self.route.redirects = 0
                continue  # the connection ended cleanly or the server went away: reconnect
            except _Redirected:
                self.route.redirects += 1
                if self.route.redirects <= _MAX_REDIRECTS:
                    continue  # straight to the replica that controls the job
                wait = random.uniform(delay / 2, delay)  # replicas disagree for now: back off
                delay = min(delay * 2, self._backoff_max)
                self.route.redirects = 0
            except _Stop:
                self._stopped = True
                return
            except Silent as exc:
                log.warning("%s; this rank tries the next backend URL and sends again what it did not "
                            "confirm, training goes on.", exc)
                self.route.move_on()
                continue
            except AgentRefused as exc:  # never again: this rank's own connection from now on
                log.warning("Not using the node agent at %s: %s. This rank connects to the backend on its own, "
                            "training goes on.", self.url, exc)
                self.route.drop_agent()
                continue
            except _AuthRefused as exc:
                log.error(
                    "The backend at %s refused this hook's token (%s). Set REBALANCER_TOKEN to a "
                    "valid hook token; retrying in %.0fs.", self.url, exc, self._auth_backoff,
                )
                wait = self._auth_backoff
            except Exception as exc:  # noqa: BLE001 - the thread must survive anything
                # Before this rank ever connected, its node agent's socket may not exist yet
                # (the agent's rank starts it, and may start later): expected, not a fault.
                first_agent_try = self.route.on_agent and self.connects == 0
                if self.connects > connects_before:  # a working connection broke: retry soon
                    delay, failures, self.route.redirects = self._backoff0, 0, 0
                    self.route.redirect = None  # the owner we were sent to broke: ask the list again
                elif first_agent_try and time.monotonic() < self.route.agent_wait_until:
                    log.debug("The node agent at %s is not up yet (%s: %s); waiting for it.",
                              self.url, type(exc).__name__, exc)
                    if self._closing.wait(random.uniform(self._backoff0 / 2, self._backoff0)):
                        break
                    continue
                else:  # this replica is unreachable: the next in the list; the owner we were sent
                    # to may be dead: ask the list again (a replica there sends us back while the
                    # owner holds the job)
                    self.route.move_on()
                if first_agent_try:  # said once; the backend's own attempts count failures
                    log.log(logging.DEBUG if self.route.fallback_said else logging.WARNING,
                            "No node agent answered at %s (%s: %s); this rank connects to the backend "
                            "on its own, training goes on.", self.url, type(exc).__name__, exc)
                    self.route.fallback_said = True
                    continue
                failures += 1
                level = logging.WARNING if failures in (1, 10) or failures % 100 == 0 else logging.DEBUG
                log.log(level, "Cannot reach the backend at %s (%s: %s); attempt %d, training goes on.",
                        self.url, type(exc).__name__, exc, failures)
                wait = random.uniform(delay / 2, delay)  # equal jitter: ranks do not retry in step
                delay = min(delay * 2, self._backoff_max)
            if self._closing.wait(wait):
                break
        self._final_flush()

    def _session(self) -> None:
        """One connection: hello, then send and receive until it closes."""
        try:
            ws = self._connect(self.url, self._open_timeout, 1.0)
        except InvalidStatus as exc:
            if self.route.on_agent:
                raise AgentRefused(f"it answered the handshake with HTTP {exc.response.status_code}") from None
            if exc.response.status_code in (401, 403):
                raise _AuthRefused(f"HTTP {exc.response.status_code} on the handshake") from None
            raise
        except InvalidURI as exc:
            log.error("Invalid backend URL %s: %s; the transport stops.", self.url, exc)
            raise _Stop from None
        self._ws = ws
        self._answered, self._unanswered, self._unanswered_control = False, [], []
        self._unconfirmed.reset()
        clean = False
        try:
            hello = self._make_hello()
            self._ident = (hello.job, hello.rank)
            ws.send(encode(hello))
            if self.relay is not None:
                for text in self.relay.hellos():
                    ws.send(text)
            self._connected = True
            self.connects += 1
            log.info("Connected to %s as job %r rank %d.", self.url, hello.job, hello.rank)
            next_flush = time.monotonic() + self._flush_s
            while not self._closing.is_set():
                self._send_control(ws)
                self._send_relay(ws)
                now_due = self._scan()
                if now_due or time.monotonic() >= next_flush or len(self._steps) >= self._flush_steps:
                    self._send_metrics(ws)
                    next_flush = time.monotonic() + self._flush_s
                self._receive(ws, _POLL_S)
                self._unconfirmed.check(ws.ping, self.url)
            self._flush(ws, self._close_deadline)
            ws.close()
            clean = True  # the close handshake: the backend read everything
        except ConnectionClosed as exc:
            # A close frame from the backend (it stops, redirects, refuses): it read what came
            # before. No close frame (killed, reset, gone): it may not have.
            clean = exc.rcvd is not None
            self._closed_by_server(exc)
        finally:
            if not clean:  # the backend may never have read them
                self._unsent[:0] = self._unconfirmed.frames
            self._unconfirmed.reset()
            self._connected = False
            self._ws = None
            ws.close_socket()

    def _connect(self, url: str, open_timeout: float, close_timeout: float) -> ClientConnection:
        if url.startswith(UNIX):  # the node agent on this machine: never the token, no compression
            return connect_agent(url[len(UNIX):], open_timeout=open_timeout, close_timeout=close_timeout)
        return connect(url, additional_headers=self._headers, open_timeout=open_timeout,
                       close_timeout=close_timeout, max_size=MAX_MESSAGE_BYTES)

    def _make_hello(self) -> Hello:
        try:
            hello = self._hello()
        except Exception as exc:
            log.exception("hello() raised; the transport retries with back-off.")
            raise ConnectionError(f"hello() raised {type(exc).__name__}") from exc
        if not isinstance(hello, Hello):
            raise ConnectionError(f"hello() must return a Hello, got {type(hello).__name__}")
        return hello

    def _closed_by_server(self, exc: ConnectionClosed) -> None:
        code = exc.rcvd.code if exc.rcvd is not None else None
        reason = exc.rcvd.reason if exc.rcvd is not None else ""
        if self.route.on_agent and code in (CLOSE_REDIRECT, CLOSE_FORBIDDEN, CLOSE_UNAUTHORIZED):
            # the agent refused this rank, or tried to send it elsewhere: an agent never redirects
            raise AgentRefused(f"it closed the connection with {code} ({reason})") from None
        if code == CLOSE_REDIRECT:
            # The error frame before the close names the owner; the close reason repeats it
            # when it fits (a send may meet the close before the frame is read).
            if reason and (self.route.redirect is None or self.route.redirect == self.url):
                self.route.follow(reason)
            if not self._answered:  # the replica read nothing after the hello: send it again
                self._unsent[:0] = self._unanswered
                self._unconfirmed.reset()  # the same frames (none was answered)
                self._control.extendleft(reversed(self._unanswered_control))
            self._unanswered, self._unanswered_control = [], []
            if self.route.redirect is not None and self.route.redirect != self.url:
                raise _Redirected from None
        if code == CLOSE_MALFORMED and self.relay is not None:
            # A backend that refuses a second rank's hello (older than node connections; a newer
            # one drops a refused rank alone): the other ranks go to their own connections.
            log.warning("The backend closed the node connection with %s (%s); the other local ranks connect on "
                        "their own from now on.", code, reason)
            self.relay.stop(f"the backend closed the node connection with {code}: {reason}")
        if code in _AUTH_CODES:
            raise _AuthRefused(f"close code {code}: {reason}") from None
        if code == CLOSE_UNSUPPORTED_VERSION and self.relay is not None and self.relay.unpack():
            log.warning("The backend does not read node frames (close %d: %s); per-rank frames now.", code, reason)
            raise ConnectionError(f"connection closed (code {code}): node frames turned off")
        if code == CLOSE_UNSUPPORTED_VERSION:
            log.error(
                "The backend does not speak this hook's protocol version (close %d: %s). Upgrade "
                "the hook or the backend so both speak the same version; metrics are no longer sent.",
                code, reason,
            )
            raise _Stop from None
        raise ConnectionError(f"connection closed (code {code}{': ' + reason if reason else ''})")

    def _receive(self, ws: ClientConnection, timeout: float) -> None:
        try:
            raw = ws.recv(timeout=timeout)
        except TimeoutError:
            return
        try:
            msg = decode(raw)
        except ProtocolError as exc:
            log.warning("Ignoring a malformed frame from the backend: %s", exc)
            return
        if not isinstance(msg, (Placement, Error)):
            log.warning("Ignoring an unexpected %r frame from the backend.", type(msg).TYPE)
            return
        if isinstance(msg, Placement):
            self._answered, self._unanswered, self._unanswered_control = True, [], []
        if isinstance(msg, Error) and msg.code == "redirect":
            if self.route.on_agent:  # only a backend replica may send a rank elsewhere
                log.warning("Ignoring a redirect to %r from the node agent at %s: an agent never redirects.",
                            msg.message[:200], self.url)
            else:
                self.route.follow(msg.message)
            return
        if isinstance(msg, Error) and msg.rank is not None:  # a node connection: one rank refused
            if self._ident is not None and msg.rank == self._ident[1]:
                log.warning("The backend refused a frame of this rank (%s: %s); saying hello again.",
                            msg.code, msg.message)
                self._control.appendleft(self._make_hello())
            elif self.relay is not None:
                self.relay.drop(msg.rank, msg.code, msg.message)
            return
        if self.relay is not None:
            self.relay.deliver(raw if isinstance(raw, str) else raw.decode())
        if isinstance(msg, Error):
            log.warning("The backend reported an error: %s (%s)", msg.message, msg.code)
        try:
            self._on_message(msg)
        except Exception:  # noqa: BLE001 - a bad callback must not kill the transport
            log.exception("on_message raised while handling a %r frame; continuing.", msg.TYPE)

    def _send_control(self, ws: ClientConnection) -> None:
        while self._control:
            msg = self._control[0]
            ws.send(encode(msg))  # raises on a dead connection: the message stays queued
            self._control.popleft()
            if not self._answered and len(self._unanswered_control) < _MAX_UNANSWERED:
                self._unanswered_control.append(msg)

    def _send_relay(self, ws: ClientConnection) -> None:
        relay = self.relay
        if relay is None:
            return
        while (text := relay.peek()) is not None:
            ws.send(text)  # raises on a dead connection: the frame stays with the relay
            relay.pop()
            self._sent(text)  # resent to the owner after a redirect, like this rank's own

    def _send_metrics(self, ws: ClientConnection) -> None:
        """Send every frame left from a broken connection, then all the queues hold."""
        while self._unsent:
            ws.send(self._unsent[0])
            self._sent(self._unsent.pop(0))
        while True:
            frame = self._build_frame()
            if frame is None:
                break
            if self.relay is not None and self.relay.carry(frame):
                continue  # one node frame carries it with the other local ranks' (node_agg.py)
            self._unsent.append(frame)
            ws.send(frame)
            self._sent(self._unsent.pop())
        self._send_relay(ws)

    def _sent(self, frame: str) -> None:
        if not self._answered and len(self._unanswered) < _MAX_UNANSWERED:
            self._unanswered.append(frame)
        self._unconfirmed.sent(frame)

    def _scan(self) -> bool:
        """Look at the steps queued since the last look (sender thread): True when one
        deviates from this rank's recent time per sample, or falls in the eager start."""
        q = self._steps
        new = list(islice(q, min(self._scanned, len(q)), None))
        self._scanned = len(q)
        due = False
        for rec in new:
            if rec.batch_index < self._eager_steps:
                due = True
            b = rec.local_batch_size
            if b <= 0 or not rec.compute_ms > 0:
                continue
            per = rec.compute_ms / b
            recent = self._per_sample
            if self._deviation > 0 and len(recent) >= 3:
                med = statistics.median(recent)
                if med > 0 and abs(per / med - 1.0) >= self._deviation:
                    self._urgent = due = True
            recent.append(per)
        return due

    def _build_frame(self) -> str | None:
        if self._ident is None:
            return None
        dropped = self.dropped - self._reported
        hang, self._hang = self._hang, None
        if not self._steps and not self._devices and dropped == 0 and hang is None:
            return None
        n = min(len(self._steps), MAX_RECORDS_PER_MESSAGE)
        m = min(len(self._devices), _MAX_DEVICE_PER_MESSAGE)
        steps = [self._steps.popleft() for _ in range(n)]
        devices = [self._devices.popleft() for _ in range(m)]
        scanned = self._scanned
        urgent, self._urgent = self._urgent, False
        job, rank = self._ident
        while True:
            frame = encode(Metrics(job=job, rank=rank, steps=steps[:n], device=devices[:m], dropped=dropped,
                                   total_steps=self.total_steps, urgent=urgent, hang=hang))
            if len(frame) <= MAX_MESSAGE_BYTES or (n <= 1 and m <= 1):
                break
            n, m = n // 2, m // 2  # rare: only huge records get here; halve until it fits
        # Put back what did not fit, at the front, so order is kept; a full deque evicts
        # from its other end, which must be counted too.
        self._requeue_dropped += _requeue(self._steps, steps[n:]) + _requeue(self._devices, devices[m:])
        self._scanned = max(0, scanned - n)  # what went back to the front was looked at
        self._reported += dropped
        return frame

    def _flush(self, ws: ClientConnection, deadline: float) -> None:
        """Best-effort send of everything queued before ``deadline``."""
        try:
            self._send_control(ws)
            self._send_relay(ws)
            while time.monotonic() < deadline:
                before = len(self._unsent) + len(self._steps) + len(self._devices)
                self._send_metrics(ws)
                if before == 0 or not (self._unsent or self._steps or self._devices):
                    break
        except ConnectionClosed:
            log.warning("The backend closed the connection while the transport was flushing.")

    def _final_flush(self) -> None:
        """close() came while disconnected: one quick attempt if there is anything to send."""
        if self._stopped or not (self._control or self._steps or self._devices or self._unsent):
            return
        remaining = self._close_deadline - time.monotonic()
        if remaining <= 0.05:
            return
        target = self.route.last_chance()
        try:
            ws = self._connect(target, min(remaining, 1.0), 0.5)
        except Exception as exc:  # noqa: BLE001
            log.info("Closing with %d unsent step records: backend unreachable (%s).", len(self._steps), exc)
            return
        with ws:
            try:
                hello = self._make_hello()
                self._ident = (hello.job, hello.rank)
                self._answered = False
                ws.send(encode(hello))
            except Exception as exc:  # noqa: BLE001
                log.info("Closing with unsent records: %s", exc)
                return
            self._flush(ws, self._close_deadline)
            # Close only once the backend answered the hello: a busy backend that reads the
            # close first could lose the frames behind it.
            try:
                while not self._answered and time.monotonic() < self._close_deadline:
                    self._receive(ws, _POLL_S)
            except ConnectionClosed:
                pass


def _requeue(q: deque[Any], rest: list[Any]) -> int:
    """Put ``rest`` back at the front of ``q`` in order; return how many fell off the back."""
    if not rest:
        return 0
    overflow = len(q) + len(rest) - (q.maxlen or 0)
    q.extendleft(reversed(rest))
    return max(0, overflow)


class _Redirected(Exception):
    """Another replica controls the job; ``Route.redirect`` says which."""


class _AuthRefused(Exception):
    """The backend refused the token (HTTP 401/403 or close 4401/4403)."""

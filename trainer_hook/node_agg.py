"""Node aggregation: the ranks of one node reach the backend through one websocket.

Local rank 0 (``LOCAL_RANK`` from torchrun) runs a ``NodeAgent``: a websocket server on a
unix socket whose path every local rank derives from the environment torchrun gives them
all (``agent_path``), in a directory only the job's user can enter. Who may talk to it is
trainer_hook/_agent_trust.py's: the peer's uid (``SO_PEERCRED``, both ends), the launch's
secret from a 0600 file beside the socket, and a hello only from the peer's own process and
as its own local rank. The other local ranks' transports connect to it first, speaking the
ordinary hook protocol; the agent checks each frame (it must be for that rank and the job)
and puts it on rank 0's transport, which sends it on rank 0's own connection after rank
0's frames. That connection says one ``hello`` per rank (docs/protocol.md, node
connections); what the backend answers (placements, errors) the agent hands to every local
rank. A rank whose connection to the agent ends gets a ``leave`` upstream.

A dead agent never blocks training: a rank that cannot reach it (or is dropped by it) uses
its own connection to the backend, with its queues intact. Frames the agent holds go out
on rank 0's connection, each rank's hello first, also those it holds while that connection
is down: they go out when it is back (``hellos`` first). ``REBALANCER_NODE_AGGREGATION`` (``1``/``0``) turns it on
or off; by default it is on when torchrun starts two or more ranks on the node.

One module, over 400 lines on purpose: the agent's server thread and the per-guest state only it
touches (who said hello as which local rank, what waits to go upstream); who may talk to it is
_agent_trust.py's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.sync.server import Server, ServerConnection, unix_serve

from rebalancer_wire.node import MAX_NODE_RECORDS, NodeMetrics, encode_node, packable
from rebalancer_wire.protocol import (
    CLOSE_CONFLICT,
    CLOSE_FORBIDDEN,
    CLOSE_GOING_AWAY,
    CLOSE_MALFORMED,
    CLOSE_NORMAL,
    CLOSE_TRY_AGAIN_LATER,
    MAX_MESSAGE_BYTES,
    MAX_RANKS_PER_CONNECTION,
    Error,
    Hello,
    Leave,
    Message,
    Metrics,
    ProtocolError,
    decode,
    encode,
)
from trainer_hook._agent_trust import (
    KEY_HEADER,
    NotPrivate,
    check_private_dir,
    launch_local_rank,
    peer_credentials,
    private_dir,
    same_secret,
    secret_path,
    write_secret,
)
from trainer_hook.transport import Transport

__all__ = ["ENV_NODE_AGGREGATION", "NodeAgent", "agent_path", "node_aggregation", "make_transport"]

log = logging.getLogger(__name__)

ENV_NODE_AGGREGATION = "REBALANCER_NODE_AGGREGATION"
_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")
_MAX_WAITING = 4096  # frames held while rank 0's connection is down (~5 min of 8 ranks' frames)
_DRAIN_S = 1.0  # how long stop() lets rank 0's connection take what the agent holds
_LAST_S = 1.5  # how long a closing rank 0 waits for the other local ranks to close first
_CLOSE_OF = {"conflict": CLOSE_CONFLICT, "forbidden": CLOSE_FORBIDDEN}  # an error's code -> a guest's close
_PACK_BYTES = MAX_MESSAGE_BYTES // 2  # a node frame packs per-rank frames of at most this many bytes in all
_TRIAL_FRAMES = 8  # node frames a backend reads before the agent trusts it speaks version 3


def node_aggregation(env: Mapping[str, str]) -> bool:
    """Whether this rank takes part in node aggregation (``REBALANCER_NODE_AGGREGATION``;
    default: on when torchrun runs two or more ranks on this node)."""
    raw = env.get(ENV_NODE_AGGREGATION, "").strip().lower()
    if raw in _ON:
        return "LOCAL_RANK" in env
    if raw in _OFF:
        return False
    if raw:
        log.error("%s must be 1 or 0, got %r; each rank uses its own connection.", ENV_NODE_AGGREGATION, raw)
        return False
    try:
        return "LOCAL_RANK" in env and int(env.get("LOCAL_WORLD_SIZE", "1")) >= 2
    except ValueError:
        return False


_MAX_UNIX_PATH = 107  # sun_path holds 108 bytes with the final NUL (Linux)


def agent_path(job: str, env: Mapping[str, str]) -> str:
    """The unix socket of this node's agent for ``job``: the same in every local rank (the
    launch's rendezvous, node and restart), and another for any other launch or job. It lies
    in this user's private directory (``_agent_trust.private_dir``, made if missing); raises
    ``OSError`` when that directory is not this user's alone (then there is no agent)."""
    key = "\0".join([job, *(env.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
                                                        "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT"))])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    path = os.path.join(private_dir(env), f"{digest}.sock")
    if len(os.fsencode(path)) > _MAX_UNIX_PATH:
        raise OSError(f"the agent's socket path {path} is longer than the {_MAX_UNIX_PATH} bytes a unix socket "
                      "allows; set REBALANCER_AGENT_DIR to a shorter private directory")
    return path


def make_transport(*, job: str, url: str, token: str | None, hello: Callable[[], Hello],
                   on_message: Callable[[Message], None], env: Mapping[str, str] | None = None,
                   **options: Any) -> Transport:
    """This rank's transport: its own connection, or one through the node's agent.

    Local rank 0 hosts the agent (``transport.relay``); the other local ranks try the agent
    first and fall back to their own connection when it cannot be reached.
    """
    env = os.environ if env is None else env
    if not node_aggregation(env):
        return Transport(url=url, token=token, hello=hello, on_message=on_message, **options)
    try:
        path = agent_path(job, env)
    except OSError as exc:  # a planted or opened-up directory: no agent on this node
        log.warning("No node agent: %s. This rank connects to the backend on its own; remove that path or "
                    "set %s to a directory only this user can enter (0700).", exc, "REBALANCER_AGENT_DIR")
        return Transport(url=url, token=token, hello=hello, on_message=on_message, **options)
    if env.get("LOCAL_RANK", "0").strip() != "0":
        return Transport(url=url, token=token, hello=hello, on_message=on_message, local_agent=path, **options)
    agent = NodeAgent(job=job, path=path, local_world_size=_int_env(env, "LOCAL_WORLD_SIZE"),
                      flush_s=float(options.get("flush_interval_s", 0.5)))
    transport = Transport(url=url, token=token, hello=hello, on_message=on_message, relay=agent, **options)
    agent.upstream = transport
    try:
        agent.start()
    except OSError as exc:  # the other ranks wait for it, then use their own connections
        log.warning("The node agent could not listen on %s (%s); each rank uses its own connection.", path, exc)
        transport.relay = None
    return transport


def _int_env(env: Mapping[str, str], key: str) -> int | None:
    try:
        return int(env.get(key, ""))
    except ValueError:
        return None


class NodeAgent:
    """The other local ranks' side of rank 0's transport (``transport.Relay``).

    Owns the unix socket server and the frames waiting to go upstream; handler threads
    (one per local rank) append, the transport thread takes. ``deque`` appends and pops
    are atomic; the lock guards the per-rank bookkeeping.
    """

    def __init__(self, *, job: str, path: str, max_waiting: int = _MAX_WAITING,
                 local_world_size: int | None = None, flush_s: float = 0.5, pack: bool = True) -> None:
        self.job = job
        self.path = path
        self.local_world_size = local_world_size
        self._secret = ""  # the launch's, written beside the socket by start()
        # local rank -> (pid, rank) of the process that said hello as it: each local rank
        # speaks from one process, for one rank, for the agent's life (a launch)
        self._claims: dict[int, tuple[int, int]] = {}
        self.upstream: Transport | None = None  # set by make_transport, for stop()'s drain
        self._max_waiting = max_waiting
        # (rank, frame, its metrics when the frame may be packed into a node frame) in arrival order
        self._waiting: deque[tuple[int, str, Metrics | None]] = deque()
        # Node frames (rebalancer_wire/node.py): the ranks' metrics waiting at the head go out
        # as one node_metrics frame, once per flush (``flush_s``, or when rank 0 flushes its own).
        self.pack = pack
        self.flush_s = flush_s
        self._packed: tuple[str, list[tuple[int, str, Metrics | None]]] | None = None  # peek()'s, until pop()
        self._metrics_since: float | None = None  # when the oldest waiting metrics frame arrived
        self._flush_due = False  # rank 0 flushed, or a frame is urgent: pack what waits now
        # Until a connection's backend has read _TRIAL_FRAMES node frames without refusing their
        # version (a backend older than node frames closes 4001 on the first), what they held is
        # kept, to be sent again per rank (``unpack``); None once one has.
        self._trial: list[tuple[int, str, Metrics | None]] | None = []
        self._trial_frames = 0
        self._hellos: dict[int, str] = {}  # rank -> its latest hello, until its leave went up
        self._latest: dict[int, int] = {}  # rank -> the batch after the last step it sent
        self._guests: dict[int, ServerConnection] = {}
        self._dropped: dict[int, int] = {}  # records of frames dropped on overflow, per rank
        self._placement: str | None = None  # the last placement, for a rank that connects late
        self._lock = threading.Lock()
        self._server: Server | None = None
        self._stopping = False
        self.relayed = 0  # frames sent upstream (diagnostics and tests)
        self.node_frames = 0  # of them, node_metrics frames

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Listen; raises ``OSError`` (then there is no agent) when the socket's directory is
        not this user's alone or its path holds something that is not our old socket."""
        check_private_dir(os.path.dirname(self.path))
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:  # a previous run's socket left behind: ours to replace; anything else is not
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
                raise NotPrivate(f"{self.path} is taken by something that is not this user's old agent socket")
            os.unlink(self.path)
        self._secret = write_secret(secret_path(self.path))
        self._server = unix_serve(self._serve, self.path, compression=None, max_size=MAX_MESSAGE_BYTES,
                                  process_request=self._handshake)
        os.chmod(self.path, 0o600)
        threading.Thread(target=self._server.serve_forever, name="rebalancer-node-agent", daemon=True).start()
        log.info("Node agent listening on %s: the other local ranks send through this rank.", self.path)

    @property
    def guests(self) -> list[int]:
        """The ranks connected through the agent now."""
        with self._lock:
            return sorted(self._guests)

    def close(self) -> None:
        """Local rank 0 is closing: the other local ranks close at about the same step, so
        wait for them (up to 1.5 s) to send their last frames and goodbyes through the
        agent, then stop (those still here go to their own connections)."""
        deadline = time.monotonic() + _LAST_S
        while self._guests and time.monotonic() < deadline:
            time.sleep(0.01)
        self.stop("this rank is closing")

    def stop(self, reason: str = "stopped") -> None:
        """Stop relaying: take no new ranks, let rank 0's connection take what waits (up to
        1 s), then close the ranks' connections with 1001 (they reconnect on their own)."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            server = self._server
        log.info("Node agent stops (%s); the other local ranks use their own connections.", reason)
        if server is not None:
            server.socket.close()  # no new connections; the open ones go on for now
            for path in (self.path, secret_path(self.path)):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        up = self.upstream
        deadline = time.monotonic() + _DRAIN_S
        while self._waiting and up is not None and up.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            guests = list(self._guests.values())
        for conn in guests:
            conn.close(CLOSE_GOING_AWAY, "the node agent stopped; connect on your own")
        deadline = time.monotonic() + _DRAIN_S / 2
        while self._guests and time.monotonic() < deadline:  # their handlers queue the leaves
            time.sleep(0.01)
        if server is not None:  # wakes serve_forever (a closed socket alone does not) and
            # waits for the handler threads: nothing of the agent outlives hook.close()
            server.shutdown(code=CLOSE_GOING_AWAY, reason="the node agent stopped; connect on your own")

    # --- one local rank's connection (a handler thread) ------------------------------------

    def _handshake(self, conn: ServerConnection, request: Request) -> Response | None:
        """Before a guest's hello: the peer is this user (the kernel says) and knows the launch's
        secret; else HTTP 403 and nothing it sends is read."""
        pid, uid, _ = peer_credentials(conn.socket)
        if uid != os.getuid():
            why = f"pid {pid} runs as uid {uid}, not as this job's user (uid {os.getuid()})"
        elif not same_secret(request.headers.get(KEY_HEADER), self._secret):
            why = f"pid {pid} did not prove it belongs to this launch (no or a wrong {KEY_HEADER})"
        else:
            return None
        log.warning("Node agent refused a connection: %s.", why)
        return conn.respond(403, "This node agent carries the frames of its own launch only.\n")

    def _serve(self, conn: ServerConnection) -> None:
        rank: int | None = None
        code = 1006
        try:
            pid = peer_credentials(conn.socket)[0]
            first = conn.recv(timeout=10.0)
            hello = decode(first)
            refusal = self._admit(hello, pid)
            if refusal is not None or not isinstance(hello, Hello):
                refusal = refusal or (CLOSE_MALFORMED, "The first message must be 'hello'.")
                log.warning("Node agent refused a local rank: %s", refusal[1])
                conn.send(encode(Error(code={CLOSE_MALFORMED: "malformed", CLOSE_FORBIDDEN: "forbidden"}.get(
                    refusal[0], "try_again_later"), message=refusal[1])))
                conn.close(refusal[0], refusal[1][:120])
                return
            rank = hello.rank
            text = first if isinstance(first, str) else first.decode()
            with self._lock:
                old = self._guests.get(rank)
                self._guests[rank] = conn
                self._hellos[rank] = text
                placement = self._placement
            if old is not None and old is not conn:
                old.close(CLOSE_NORMAL, "replaced by a newer connection of the same rank")
            self._put(rank, text)
            if placement is not None:
                conn.send(placement)
            for raw in conn:
                msg = decode(raw)
                if isinstance(msg, Hello) or msg.TYPE in ("metrics", "ack", "reject", "oom"):
                    if getattr(msg, "job", None) != self.job or getattr(msg, "rank", None) != rank:
                        raise ProtocolError(f"This connection speaks for job '{self.job}' rank {rank}; got a "
                                            f"'{msg.TYPE}' for job '{getattr(msg, 'job', '')}' rank "
                                            f"{getattr(msg, 'rank', '')}.")
                else:
                    raise ProtocolError(f"Hooks may not send '{msg.TYPE}' messages; expected metrics, ack, "
                                        f"reject or oom.")
                if isinstance(msg, Hello) and (msg.local_rank, msg.pid) != (hello.local_rank, hello.pid):
                    raise ProtocolError(f"This connection speaks for local rank {hello.local_rank} (pid "
                                        f"{hello.pid}); got a 'hello' as local rank {msg.local_rank} (pid {msg.pid}).")
                text = raw if isinstance(raw, str) else raw.decode()
                if isinstance(msg, Hello):
                    with self._lock:
                        self._hellos[rank] = text
                elif isinstance(msg, Metrics) and msg.steps:
                    top = max(st.batch_index for st in msg.steps) + 1
                    with self._lock:
                        self._latest[rank] = max(self._latest.get(rank, 0), top)
                self._put(rank, text, msg if isinstance(msg, Metrics) and packable(msg) else None)
            rcvd = conn.protocol.close_rcvd
            code = rcvd.code if rcvd is not None else 1006
        except ProtocolError as exc:
            log.warning("Node agent closes local rank %s: %s", rank, exc)
            code = CLOSE_MALFORMED
            try:
                conn.send(encode(Error(code=exc.code, message=str(exc))))
                conn.close(exc.close_code, str(exc)[:120])
            except ConnectionClosed:
                pass
        except (ConnectionClosed, TimeoutError) as exc:
            rcvd = getattr(exc, "rcvd", None)
            code = rcvd.code if rcvd is not None else 1006
        finally:
            if rank is not None:
                self._gone(rank, conn, code)

    def _admit(self, hello: Message, pid: int) -> tuple[int, str] | None:
        if not isinstance(hello, Hello):
            return CLOSE_MALFORMED, f"The first message must be 'hello', got '{hello.TYPE}'."
        if hello.job != self.job:
            return CLOSE_MALFORMED, (f"This node agent carries job '{self.job}'; connect on your own for job "
                                     f"'{hello.job}'.")
        refusal = self._identity(hello, pid)
        if refusal is not None:
            return CLOSE_FORBIDDEN, refusal
        with self._lock:
            if self._stopping:
                return CLOSE_TRY_AGAIN_LATER, "The node agent is stopping; connect on your own."
            if hello.rank not in self._guests and len(self._guests) >= MAX_RANKS_PER_CONNECTION - 1:
                return CLOSE_TRY_AGAIN_LATER, (f"The node agent carries {MAX_RANKS_PER_CONNECTION - 1} ranks "
                                               f"already; connect on your own.")
            self._claims[hello.local_rank] = (pid, hello.rank)
        return None

    def _identity(self, hello: Hello, pid: int) -> str | None:
        """Why a guest may not say this hello (None: it may): it speaks only from its own process
        (the kernel's pid), as its own local rank, and a local rank for one process and rank."""
        lr = hello.local_rank
        if hello.pid != pid:
            return f"A local rank says hello from its own process only: this hello says pid {hello.pid}, the " \
                   f"connection is from pid {pid}."
        size = self.local_world_size
        if lr == 0 or (size is not None and lr >= size):
            return f"A guest of this node agent is local rank 1 to {(size or 2) - 1}; this hello says local rank {lr}."
        if pid != os.getpid():  # another process: the local rank torchrun started it as, where known
            started = launch_local_rank(pid)
            if started is not None and started != lr:
                return f"Process {pid} was started as local rank {started}; it may not say hello as local rank {lr}."
        with self._lock:
            held = self._claims.get(lr)
            if held is not None and held != (pid, hello.rank):
                return f"Local rank {lr} speaks from pid {held[0]} as rank {held[1]}; this hello (pid {pid}, rank " \
                       f"{hello.rank}) may not take it over."
            for other, (p, r) in self._claims.items():
                if other != lr and r == hello.rank:
                    return f"Rank {hello.rank} is local rank {other}'s; local rank {lr} may not say hello as it."
                if other != lr and p == pid and pid != os.getpid():
                    return f"Pid {pid} speaks as local rank {other}; it may not say hello as local rank {lr} too."
        return None

    def _gone(self, rank: int, conn: ServerConnection, code: int) -> None:
        with self._lock:
            if self._guests.get(rank) is not conn:
                return  # replaced by a newer connection of the same rank
            del self._guests[rank]
            if self._stopping and code == CLOSE_NORMAL:
                code = CLOSE_GOING_AWAY  # we closed it: it moves to its own connection
        self._put(rank, encode(Leave(job=self.job, rank=rank, code=code)))

    def _put(self, rank: int, text: str, metrics: Metrics | None = None) -> None:
        with self._lock:
            self._waiting.append((rank, text, metrics))
            if metrics is not None:
                if self._metrics_since is None:
                    self._metrics_since = time.monotonic()
                if metrics.urgent:
                    self._flush_due = True
            if len(self._waiting) > self._max_waiting:
                self._overflow()

    def carry(self, text: str) -> bool:
        """Rank 0's own metrics frame, handed over at its flush: it goes out in the node frame
        with what the other local ranks sent since (then at once). False: send it yourself
        (node frames off, or a frame that is not plain metrics)."""
        if not self.pack or not text.startswith('{"type":"metrics"'):
            return False
        msg = decode(text)
        if not isinstance(msg, Metrics) or not packable(msg) or msg.job != self.job:
            return False
        with self._lock:
            self._flush_due = True
        self._put(msg.rank, text, msg)
        return True

    def _overflow(self) -> None:
        """Drop the oldest metrics frame (acks, rejects, hellos and leaves stay) and count
        its records; the count goes upstream in a metrics frame of that rank. Lock held."""
        packed = {id(item) for item in self._packed[1]} if self._packed is not None else set()
        for i, item in enumerate(self._waiting):
            rank, text, _ = item
            if text.startswith('{"type":"metrics"') and id(item) not in packed:  # peek()'s stay until pop()
                del self._waiting[i]
                body = json.loads(text)
                n = len(body.get("steps", ())) + len(body.get("device", ())) + int(body.get("dropped", 0))
                self._dropped[rank] = self._dropped.get(rank, 0) + n
                return
        log.error("More than %d control frames wait for the node connection; dropping the oldest.",
                  self._max_waiting)
        for i, item in enumerate(self._waiting):
            if id(item) not in packed:
                del self._waiting[i]
                return

    # --- transport.Relay: rank 0's transport thread ----------------------------------------

    def unpack(self) -> bool:
        """A backend older than node frames refused one (4001): send each rank's frames as they
        are from now on, the node frames it refused first (transport.Relay). False: no node
        frame was sent to take back, or a backend read them before."""
        with self._lock:
            if not self.pack or not self._trial:
                return False
            self.pack, trial, self._trial, self._packed = False, self._trial, None, None
            self._waiting.extendleft(reversed(trial))
        log.warning("The backend does not read node frames; the node agent relays each rank's frames as they are.")
        return True

    def hellos(self) -> list[str]:
        """Each guest's hello, its batch index brought up to what the guest has sent since (the
        backend bounds a step's distance from its rank's hello: MAX_BATCH_JUMP)."""
        with self._lock:
            if self._trial is not None:  # a new connection: its backend proves itself anew
                self._trial, self._trial_frames = [], 0
            held = list(self._hellos.items())
            latest = dict(self._latest)
        out = []
        for rank, text in held:
            nxt = latest.get(rank)
            if nxt is not None:
                hello = decode(text)
                if isinstance(hello, Hello) and hello.batch_index < nxt:
                    text = encode(dataclasses.replace(hello, batch_index=nxt))
            out.append(text)
        return out

    def peek(self) -> str | None:
        with self._lock:
            if self._packed is not None:
                return self._packed[0]
            if self._dropped:
                dropped, self._dropped = self._dropped, {}
                for rank, n in dropped.items():
                    report = Metrics(job=self.job, rank=rank, steps=[], device=[], dropped=n)
                    self._waiting.appendleft((rank, encode(report), report))
            if not self._waiting:
                return None
            rank, text, msg = self._waiting[0]
            if msg is None or not self.pack:
                return text
            since = self._metrics_since
            due = (self._flush_due or self._stopping or since is None or time.monotonic() - since >= self.flush_s
                   or len(self._waiting) >= self._max_waiting // 2)
            if not due:
                return None  # the ranks' metrics wait for the node's flush (control frames behind them too)
            run = self._run()
            if len(run) == 1:
                self._packed = (text, run)
            else:
                self._packed = (encode_node(NodeMetrics.pack(self.job, [m for _, _, m in run if m is not None])), run)
            return self._packed[0]

    def _run(self) -> list[tuple[int, str, Metrics | None]]:
        """The metrics frames at the head of the queue that one node frame takes (lock held)."""
        run: list[tuple[int, str, Metrics | None]] = []
        ranks: set[int] = set()
        size = steps = device = 0
        for item in self._waiting:
            rank, text, msg = item
            if msg is None:
                break
            size, steps, device = size + len(text), steps + len(msg.steps), device + len(msg.device)
            if run and (size > _PACK_BYTES or steps > MAX_NODE_RECORDS or device > MAX_NODE_RECORDS
                        or (rank not in ranks and len(ranks) >= MAX_RANKS_PER_CONNECTION)):
                break
            ranks.add(rank)
            run.append(item)
        return run

    def pop(self) -> None:
        with self._lock:
            packed, self._packed = self._packed, None
            self.relayed += 1
            if packed is not None:
                sent = {id(item) for item in packed[1]}
                self._waiting = deque(item for item in self._waiting if id(item) not in sent)
                if len(packed[1]) > 1:
                    self.node_frames += 1
                    if self._trial is not None:
                        self._trial.extend(packed[1])
                        self._trial_frames += 1
                        if self._trial_frames > _TRIAL_FRAMES:
                            self._trial = None  # the backend reads them
                self._flush_due = False
                self._metrics_since = next((time.monotonic() for _, _, m in self._waiting if m is not None), None)
                return
            rank, text, _ = self._waiting.popleft()
            if text.startswith('{"type":"leave"') and rank not in self._guests:
                self._hellos.pop(rank, None)

    def drop(self, rank: int, code: str, message: str) -> None:
        """The backend refused one guest's frame: that guest alone is closed (with the close
        code it would have got on its own connection) and what it has waiting is dropped; it
        reconnects, and the others go on."""
        with self._lock:
            conn = self._guests.get(rank)
            self._waiting = deque(item for item in self._waiting if item[0] != rank)
            self._packed = None  # built again without it
            self._hellos.pop(rank, None)
            self._latest.pop(rank, None)
        log.warning("The backend refused local rank %s's frame (%s: %s); closing that rank's connection to the "
                    "node agent.", rank, code, message)
        if conn is not None:
            try:
                conn.close(_CLOSE_OF.get(code, CLOSE_MALFORMED), message[:120])
            except ConnectionClosed:
                pass

    def deliver(self, raw: str) -> None:
        if raw.startswith('{"type":"placement"'):
            with self._lock:
                if raw == self._placement:
                    return  # each rank's hello is answered with the same placement: once is enough
                self._placement = raw
        with self._lock:
            guests = list(self._guests.values())
        for conn in guests:
            try:
                conn.send(raw)
            except ConnectionClosed:
                pass


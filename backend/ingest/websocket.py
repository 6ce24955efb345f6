"""The conversation of ``/ws/hook`` (the route in ``backend/api/routes/hook.py`` authenticates
and hands the socket here): hello, then metrics, acks and rejects.

Conversation (docs/protocol.md): the hook authenticates (hook token scoped to the job, or
an admin token; none needed in open mode), sends ``hello`` first and gets the placement in
force back, then streams ``metrics`` and answers placements with ``ack`` or ``reject``.
Any bad frame gets an ``error`` message and a close code; one bad connection never
disturbs the others.

One module, over 400 lines on purpose: the /ws/hook conversation's rules in order (hello,
metrics, acks, rejects, node connections), each refusal with its sentence."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from fastapi import WebSocket, WebSocketDisconnect

from backend.auth.access import SEND_METRICS, allows
from backend.auth.sockets import TokenSockets
from backend.auth.tokens import Actor
from backend.control.controller import Controller
from backend.dashboard.hub import DashboardHub
from backend.live.pipeline import pipeline_conflict, same_pipeline
from backend.live.state import LiveState
from backend.peers.budget import (
    HOOK_BYTES_BURST,
    HOOK_BYTES_PER_S,
    HOOK_FRAMES_BURST,
    HOOK_FRAMES_PER_S,
    HOOK_HELLO_FRAMES,
    FrameBudget,
)
from backend.peers.connections import HookConnections, redirect_reason
from backend.settings import Settings
from backend.storage.gateway import SqlGateway
from backend.storage.health import report_fault
from backend.storage.hellos import HelloWriter
from backend.storage.writes import database_fault
from rebalancer_wire.node import NodeMetrics, decode_frame
from rebalancer_wire.protocol import (
    CLOSE_CONFLICT,
    CLOSE_FORBIDDEN,
    CLOSE_MALFORMED,
    CLOSE_NORMAL,
    CLOSE_RATE_LIMITED,
    CLOSE_REDIRECT,
    CLOSE_TRY_AGAIN_LATER,
    MAX_BATCH_JUMP,
    MAX_RANKS_PER_CONNECTION,
    PROTOCOL_VERSION,
    Ack,
    Error,
    Hello,
    Leave,
    MeshShape,
    Metrics,
    Oom,
    ProtocolError,
    Reject,
    encode,
)

if TYPE_CHECKING:
    from backend.cluster import JobLeases

__all__ = ["IngestParts", "converse", "refuse"]

log = logging.getLogger("rebalancer.ingest")
CLOSE_INTERNAL = 1011
# While the database refuses writes, a connection's hello is stored (and its control state
# made) again on its metrics, at most this often.
HELLO_RETRY_S = 2.0
T = TypeVar("T")


class IngestParts(Protocol):
    """What the conversation uses of the app's parts (``backend.parts.Parts`` has them)."""

    settings: Settings
    sql: SqlGateway
    hellos: HelloWriter  # the hellos' rows, stored by the batch
    live: LiveState
    connections: HookConnections
    sockets: TokenSockets
    controller: Controller
    hub: DashboardHub
    cluster: JobLeases | None  # several replicas: who controls each job; None: one replica

    def make_room(self, job: str) -> bool: ...

    def run_ended(self, job: str) -> None: ...


async def _unless_database_fault(what: str, work: Awaitable[T]) -> tuple[bool, T | None]:
    """``(True, result)``; ``(False, None)`` when the database failed (logged, rate-limited):
    live ingest goes on from memory while the database is away."""
    try:
        return True, await work
    except Exception as exc:
        if not database_fault(exc):
            raise
        report_fault(log, what, exc)
        return False, None
_CLEAN_CLOSE = (1000, 1001)  # the hook closed (job done) or went away on purpose


async def refuse(ws: WebSocket, code: str, message: str, close_code: int) -> None:
    with contextlib.suppress(Exception):
        await ws.send_text(encode(Error(code=code, message=message)))
    with contextlib.suppress(Exception):
        await ws.close(close_code, reason=message[:120])


@dataclass(slots=True)
class _Rank:
    """What a connection knows of one rank it speaks for."""

    hello: Hello
    version: int  # the protocol version its hello spoke
    stored: bool  # False while the database refused its hello
    retry_at: float
    last_batch_index: int  # its hello's, then the highest it sent (MAX_BATCH_JUMP is counted from it)


def _speaks_for(job: str, ranks: Iterable[int]) -> str:
    rs = sorted(ranks)
    if not rs:
        return f"job '{job}' and no rank now (each left)"
    if len(rs) == 1:
        return f"job '{job}' rank {rs[0]}"
    shown = ", ".join(map(str, rs[:8])) + (f" and {len(rs) - 8} more" if len(rs) > 8 else "")
    return f"job '{job}' ranks {shown}"


async def converse(parts: IngestParts, websocket: WebSocket, actor: Actor) -> None:
    """One accepted, authenticated connection: hello, then metrics / ack / reject frames.

    A connection speaks for one rank, or (a node connection, docs/protocol.md) for several
    ranks of one job, each after its own hello; every frame is checked as on a rank's own."""
    ranks: dict[int, _Rank] = {}
    job: str | None = None
    pending: Hello | None = None  # a hello being registered (cleaned up if the socket fails meanwhile)
    answering: list[asyncio.Task[None]] = []  # hellos admitted, being stored and answered
    lost = False  # the peer vanished without a close frame
    budget = FrameBudget(frames_per_s=HOOK_FRAMES_PER_S, frames_burst=HOOK_FRAMES_BURST,
                         bytes_per_s=HOOK_BYTES_PER_S, bytes_burst=HOOK_BYTES_BURST)
    goodbye = False  # the hook closed normally (its close()): this rank is done
    dropped: set[int] = set()  # ranks of a node connection refused alone; their late frames are ignored

    async def refuse_rank(rank: int, code: str, message: str, close_code: int) -> bool:
        """One rank's frame is refused: on a node connection that rank alone is dropped (an
        ``error`` naming it; the others go on), else the connection is closed. True: closed."""
        if not any(r != rank for r in ranks):
            await refuse(websocket, code, message, close_code)
            return True
        log.info("dropping job %s rank %d from its node connection: %s", job, rank, message)
        with contextlib.suppress(Exception):
            await websocket.send_text(encode(Error(code=code, message=message, rank=rank)))
        dropped.add(rank)
        state = ranks.pop(rank, None)
        if state is not None:
            _rank_gone(parts, websocket, state.hello, lost=True, goodbye=False)
        return False

    parts.sockets.add(actor, websocket)
    try:
        while True:
            frame = await websocket.receive()
            if frame["type"] == "websocket.disconnect":
                lost = frame.get("code", 1005) not in _CLEAN_CLOSE
                goodbye = frame.get("code") == CLOSE_NORMAL
                break
            raw = frame.get("text")
            if raw is None:
                raw = frame.get("bytes")
            if raw is None:
                continue
            over = budget.take(len(raw))
            if over is not None:
                log.warning("closing hook connection from %s: %s", actor.address, over)
                await refuse(websocket, "rate_limited", over, CLOSE_RATE_LIMITED)
                return
            try:
                msg, version = decode_frame(raw)
            except ProtocolError as exc:
                parts.live.count_refused(_kind_of(raw), exc.code)
                sender = _rank_of(raw) if len(ranks) > 1 else None
                if sender is not None and sender in ranks:  # one rank's bad frame on a node connection
                    if await refuse_rank(sender, exc.code, str(exc), exc.close_code):
                        return
                    continue
                log.info("closing hook connection from %s: %s", actor.address, exc)
                await refuse(websocket, exc.code, str(exc), exc.close_code)
                return
            if isinstance(msg, Hello) and (over := budget.take(0, HOOK_HELLO_FRAMES - 1)) is not None:
                log.warning("closing hook connection from %s: %s", actor.address, over)
                await refuse(websocket, "rate_limited", over, CLOSE_RATE_LIMITED)
                return
            if job is None or isinstance(msg, Hello):
                if not isinstance(msg, Hello):
                    await refuse(websocket, "malformed",
                                  f"The first message must be 'hello', got '{msg.TYPE}'.", CLOSE_MALFORMED)
                    return
                if not allows(actor, SEND_METRICS, job=msg.job):
                    await refuse(websocket, "forbidden",
                                  f"This hook token is for job '{actor.job}'; it may not speak for job '{msg.job}'.",
                                  CLOSE_FORBIDDEN)
                    return
                if job is not None and msg.job != job:
                    await refuse(websocket, "malformed",
                                  f"This connection speaks for {_speaks_for(job, ranks)}; "
                                  f"open a new connection for job '{msg.job}' rank {msg.rank}.",
                                  CLOSE_MALFORMED)
                    return
                if msg.rank not in ranks and len(ranks) >= MAX_RANKS_PER_CONNECTION:
                    await refuse(websocket, "malformed",
                                  f"A connection speaks for at most {MAX_RANKS_PER_CONNECTION} ranks; got a hello "
                                  f"for a rank beyond them ({msg.rank}). Open another connection.", CLOSE_MALFORMED)
                    return
                known = ranks.get(msg.rank)
                if known is not None and abs(msg.batch_index - known.last_batch_index) > MAX_BATCH_JUMP:
                    if await refuse_rank(msg.rank, "malformed", (
                            f"'batch_index' is {msg.batch_index}, {msg.batch_index - known.last_batch_index:+d} "
                            f"from this rank's last ({known.last_batch_index}) on this connection; it must be within "
                            f"{MAX_BATCH_JUMP} of it (MAX_BATCH_JUMP). A run resumed elsewhere connects anew."),
                            CLOSE_MALFORMED):
                        return
                    continue
                if any(r != msg.rank for r in ranks):  # a node connection: a refused rank goes alone
                    refusal, _ = _reshape_refusal(parts, websocket, msg)
                    if refusal is not None:
                        log.warning("refused hello of job %s rank %d: %s", msg.job, msg.rank, refusal)
                        await refuse_rank(msg.rank, "conflict", refusal, CLOSE_CONFLICT)
                        continue
                if ranks and msg.rank not in ranks:
                    budget.widen(len(ranks) + 1)  # a node connection: each rank brings its budget
                pending = msg
                admitted = await _admit_hello(parts, websocket, msg, version)
                pending = None
                if not admitted:
                    return
                job = msg.job
                dropped.discard(msg.rank)
                held = ranks[msg.rank] = _Rank(msg, version, False, time.monotonic() + HELLO_RETRY_S,
                                               msg.batch_index)
                # Stored and answered while the next frames are read: a node's hellos, sent
                # together, go to the database in one transaction (HelloWriter), not one each.
                answering.append(asyncio.create_task(_answer_hello(parts, websocket, held)))
                continue
            if answering:  # a rank's other frames wait until the hellos before them are answered
                await asyncio.gather(*answering)
                answering.clear()
            if isinstance(msg, NodeMetrics):
                if job is None or not await _node_frame(parts, websocket, msg, job, ranks, dropped, refuse_rank):
                    return
                continue
            if not isinstance(msg, (Metrics, Ack, Reject, Oom, Leave)):
                await refuse(websocket, "malformed",
                              f"Hooks may not send '{msg.TYPE}' messages; expected metrics, ack, reject, oom or leave.",
                              CLOSE_MALFORMED)
                return
            state = ranks.get(msg.rank)
            if msg.job == job and state is None and msg.rank in dropped:
                continue  # sent before its node's agent dropped it: ignored, as after a close
            if msg.job != job or state is None:
                parts.live.count_refused(msg.TYPE, "malformed")
                await refuse(websocket, "malformed",
                              f"This connection speaks for {_speaks_for(job, ranks)}; "
                              f"got a '{msg.TYPE}' for job '{msg.job}' rank {msg.rank}.",
                              CLOSE_MALFORMED)
                return
            hello = state.hello
            if parts.connections.current(hello.job, hello.rank) is not websocket:
                # replaced by a newer connection of this rank, or its job restarted
                del ranks[msg.rank]
                if not any(parts.connections.current(job, r) is websocket for r in ranks):
                    return  # nothing left to speak for: being closed
                continue
            if isinstance(msg, Leave):
                del ranks[msg.rank]
                _rank_gone(parts, websocket, hello, lost=msg.code not in _CLEAN_CLOSE,
                           goodbye=msg.code == CLOSE_NORMAL)
                continue
            if isinstance(msg, Metrics):
                try:
                    msg.check_against(hello, time.time(), state.last_batch_index)
                except ProtocolError as exc:
                    parts.live.count_refused(msg.TYPE, exc.code)
                    log.info("refusing a frame of job %s rank %d: %s", hello.job, hello.rank, exc)
                    if await refuse_rank(msg.rank, exc.code, str(exc), exc.close_code):
                        return
                    continue
                if msg.steps:
                    state.last_batch_index = max(state.last_batch_index, max(s.batch_index for s in msg.steps))
                parts.live.add_metrics(msg)
                if not state.stored and time.monotonic() >= state.retry_at:
                    state.stored = await _hello_to_sql(parts, websocket, hello, version=state.version)
                    state.retry_at = time.monotonic() + HELLO_RETRY_S
                parts.controller.on_metrics(msg.job, urgent=msg.urgent)
                parts.hub.notify(msg.job)
            elif isinstance(msg, Ack):
                # An ack lost here is taken from the rank's metrics later (acks from metrics).
                await _unless_database_fault("recording an ack", parts.controller.on_ack(msg))
                parts.hub.notify(msg.job)
            elif isinstance(msg, Oom):
                log.warning("job %s rank %d ran out of memory at %d samples (placement %d): %s",
                            msg.job, msg.rank, msg.local_batch_size, msg.version, msg.message)
                await parts.controller.on_oom(msg)
                parts.hub.notify(msg.job)
            else:
                log.warning("job %s rank %d rejected placement %d: %s", msg.job, msg.rank, msg.version, msg.reason)
                await _unless_database_fault("recording a reject", parts.controller.on_reject(msg))
                parts.hub.notify(msg.job)
    except WebSocketDisconnect as exc:
        lost = exc.code not in _CLEAN_CLOSE
    except Exception:  # a bug in one handler must not take the server or other ranks down
        log.exception("hook connection failed (job=%s ranks=%s)", job, sorted(ranks))
        await refuse(websocket, "internal", "The backend failed to handle this message; see its log.",
                      CLOSE_INTERNAL)
    finally:
        if answering:  # a hello just before the close (or a refused frame) is still stored and registered
            await asyncio.gather(*answering, return_exceptions=True)
        parts.sockets.discard(actor, websocket)
        gone = [state.hello for state in ranks.values()]
        if pending is not None and pending.rank not in ranks:
            gone.append(pending)
        for hello in gone:
            _rank_gone(parts, websocket, hello, lost=lost, goodbye=goodbye)


async def _node_frame(parts: IngestParts, websocket: WebSocket, msg: NodeMetrics, job: str,
                      ranks: dict[int, _Rank], dropped: set[int],
                      refuse_rank: Callable[[int, str, str, int], Awaitable[bool]]) -> bool:
    """Fold one node frame (docs/protocol.md, ``node_metrics``) into live state in one pass.
    A frame of another job or naming a rank that said no hello on this connection is
    refused whole (4002: nothing of it is kept); a rank whose records fail the checks that
    need its hello is refused alone, the others' records are kept. False: closed."""
    unknown = sorted(r for r in msg.ranks if r not in ranks and r not in dropped)
    if msg.job != job or unknown:
        parts.live.count_refused(msg.TYPE, "malformed")
        what = f"job '{msg.job}'" if msg.job != job else \
            f"rank{'s' if len(unknown) > 1 else ''} {', '.join(map(str, unknown[:8]))}" \
            f"{f' and {len(unknown) - 8} more' if len(unknown) > 8 else ''} without a hello on it"
        await refuse(websocket, "malformed", f"This connection speaks for {_speaks_for(job, ranks)}; got a "
                     f"'node_metrics' frame with {what}. Say hello for each rank first.", CLOSE_MALFORMED)
        return False
    skip = {r for r in msg.ranks if r not in ranks}  # sent before the agent dropped them: ignored
    for r in msg.ranks:
        if r in ranks and parts.connections.current(job, r) is not websocket:
            del ranks[r]  # replaced by a newer connection of this rank, or its job restarted
            skip.add(r)
    if not ranks:
        return False  # nothing left to speak for: being closed
    bad = msg.check_against({r: st.hello for r, st in ranks.items() if r not in skip}, time.time(),
                            {r: st.last_batch_index for r, st in ranks.items()})
    for r, exc in sorted(bad.items()):
        parts.live.count_refused(msg.TYPE, exc.code)
        log.info("refusing rank %d of a node frame of job %s: %s", r, job, exc)
        if await refuse_rank(r, exc.code, str(exc), exc.close_code):
            return False
        skip.add(r)
    for rank, s0, s1, _, _ in msg.spans():
        if s1 > s0 and rank not in skip:
            state = ranks[rank]
            state.last_batch_index = max(state.last_batch_index, msg.newest_batch(s0, s1))
    parts.live.add_node_metrics(msg, skip)
    for rank in msg.ranks:
        held = ranks.get(rank) if rank not in skip else None
        if held is not None and not held.stored and time.monotonic() >= held.retry_at:
            held.stored = await _hello_to_sql(parts, websocket, held.hello, version=held.version)
            held.retry_at = time.monotonic() + HELLO_RETRY_S
    parts.controller.on_metrics(job, urgent=any(r not in skip for r in msg.urgent))
    parts.hub.notify(job)
    return True


def _kind_of(raw: str | bytes) -> str:
    """What a refused frame was, for the refusal count (its head, not parsed again)."""
    head = raw[:64] if isinstance(raw, str) else raw[:64].decode("utf-8", "replace")
    return "node_metrics" if '"node_metrics"' in head else "metrics" if '"metrics"' in head else "other"


def _rank_of(raw: str | bytes) -> int | None:
    """The ``rank`` a frame that failed to decode names, when it names one plainly."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    rank = body.get("rank") if isinstance(body, dict) else None
    return rank if type(rank) is int else None


def _rank_gone(parts: IngestParts, websocket: WebSocket, hello: Hello, *, lost: bool, goodbye: bool) -> None:
    """``websocket`` no longer speaks for ``hello``'s rank (closed, or a node connection's leave)."""
    parts.connections.remove(hello.job, hello.rank, websocket)
    if not parts.connections.has(hello.job, hello.rank):
        parts.live.set_connected(hello.job, hello.rank, False, lost=lost)
        if goodbye and parts.live.said_goodbye(hello.job, hello.rank):
            parts.run_ended(hello.job)
    with contextlib.suppress(Exception):
        parts.hub.notify(hello.job)


async def _claim(cluster: JobLeases, websocket: WebSocket, hello: Hello) -> bool:
    """Several replicas: the hello stays here when this replica holds (or just took) the job's
    lease, or while Redis is down (training and ingest go on, control pauses); else the hook
    is sent to the owner's advertised URL (False: refused)."""
    claim = await cluster.claim(hello.job)
    if claim.outcome != "redirect":
        return True
    if claim.url:
        log.info("job %s rank %d: redirected to replica %s at %s", hello.job, hello.rank, claim.owner, claim.url)
        with contextlib.suppress(Exception):
            await websocket.send_text(encode(Error(code="redirect", message=claim.url)))
        with contextlib.suppress(Exception):
            await websocket.close(CLOSE_REDIRECT, reason=redirect_reason(claim.url, hello.job))
        return False
    await refuse(websocket, "try_again_later",
                 f"Job '{hello.job}' is controlled by replica {claim.owner or '(unknown)'}, which advertises no "
                 f"URL (its lease expires within REBALANCER_LEASE_TTL_S if it is gone); try again.",
                 CLOSE_TRY_AGAIN_LATER)
    return False


def _reshape_refusal(parts: IngestParts, websocket: WebSocket, hello: Hello) -> tuple[str | None, bool]:
    """(why this hello is refused or None, whether it changes the job's shape).

    A hello may change a live job's world size or global batch only when no rank of the old
    shape is connected, or when it comes from a TorchElastic restart (a restart count above
    every connected rank's)."""
    shape = parts.live.shape(hello.job)
    new = (hello.world_size, hello.global_batch_size)
    if shape is None:
        return None, False
    mesh = parts.live.mesh(hello.job)
    pipe = parts.live.pipelines.shape(hello.job)
    if shape == new and mesh == hello.mesh and same_pipeline(pipe, hello.pipeline):
        return None, False
    # Every connected rank but this one, on any connection: on a single-node job all of them
    # share the node connection this hello came on.
    others = [r for r in parts.connections.ranks(hello.job) if r != hello.rank]
    counts = [h.restart_count for r in others if (h := parts.live.hello(hello.job, r)) is not None]
    if not others or hello.restart_count > max(counts, default=-1):
        return None, shape != new
    if shape == new and mesh == hello.mesh:
        return pipeline_conflict(hello, pipe, len(others)), False
    if shape == new:
        return (f"Job '{hello.job}' runs as {_mesh_words(mesh)} on {len(others)} connected replica "
                f"leader{'s' if len(others) != 1 else ''}; this hello says {_mesh_words(hello.mesh)}. Every "
                f"replica leader of one job must say the same mesh: pass every rank its slice of one "
                f"world mesh as dp_mesh, or use another job name."), False
    return (f"Job '{hello.job}' is running with world_size {shape[0]} and global batch {shape[1]} on "
            f"{len(others)} connected rank{'s' if len(others) != 1 else ''}; this hello says world_size "
            f"{new[0]} and global batch {new[1]}. Stop those ranks or use another job name (a torchrun "
            f"restart, with a higher restart count, may change the shape)."), True


def _mesh_words(mesh: MeshShape | None) -> str:
    if mesh is None:
        return "plain data parallel (no mesh)"
    return f"mesh {mesh.label} ({mesh.dp} replicas of {mesh.replica_size} ranks)"


async def _admit_hello(parts: IngestParts, websocket: WebSocket, hello: Hello, version: int) -> bool:
    """Register the rank live (the job's owner, its shape, room for it); False when the hello
    was refused (the socket is closed). ``_answer_hello`` then stores it and answers."""
    if parts.cluster is not None and not await _claim(parts.cluster, websocket, hello):
        return False
    refusal, reshaped = _reshape_refusal(parts, websocket, hello)
    if refusal is not None:
        log.warning("refused hello of job %s rank %d: %s", hello.job, hello.rank, refusal)
        await refuse(websocket, "conflict", refusal, CLOSE_CONFLICT)
        return False
    if not parts.make_room(hello.job):
        cap = parts.settings.max_live_jobs
        log.warning("refused hello of job %s: %d live jobs have connected ranks", hello.job, cap)
        await refuse(websocket, "try_again_later",
                      f"The backend holds {cap} live jobs with connected ranks (REBALANCER_MAX_LIVE_JOBS); "
                      f"job '{hello.job}' can start once one of them ends.", CLOSE_TRY_AGAIN_LATER)
        return False
    if reshaped:
        await parts.connections.close_job(
            hello.job, CLOSE_CONFLICT,
            f"job '{hello.job}' restarted with world_size {hello.world_size}; this is the previous attempt's connection",
            keep=websocket)
    parts.live.register(hello)
    parts.controller.expect(hello.job)  # the job is listed now: actions on it wait for on_hello
    old = parts.connections.add(hello.job, hello.rank, websocket, version)
    if old is not None and not parts.connections.serves(old):
        log.info("job %s rank %d reconnected; closing its previous socket", hello.job, hello.rank)
        with contextlib.suppress(Exception):
            await old.close(1000, reason="replaced by a newer connection of the same rank")
    return True


async def _answer_hello(parts: IngestParts, websocket: WebSocket, held: _Rank) -> None:
    """Store an admitted hello and answer it with the placement in force. While the database
    refuses it, the rank streams on (live state, dashboard) and keeps the placement it has;
    storing and the reply are tried again on its metrics."""
    held.stored = await _hello_to_sql(parts, websocket, held.hello, held.version)
    parts.hub.notify(held.hello.job)


async def _hello_to_sql(parts: IngestParts, websocket: WebSocket, hello: Hello,
                        version: int = PROTOCOL_VERSION) -> bool:
    # With the hellos that arrive meanwhile (the other ranks of the node and of the job): one
    # transaction for them all.
    ok, _ = await _unless_database_fault("storing a hello", parts.hellos.store(hello))
    if not ok:
        return False
    ok, placement = await _unless_database_fault("answering a hello", parts.controller.on_hello(hello))
    if not ok or placement is None:
        return False
    try:
        # In the version the hook speaks; encoded once for all the job's hellos.
        await websocket.send_text(parts.connections.text(placement, version))
    except Exception as exc:  # the hook closed already (a last flush): still read what it sent
        log.info("job %s rank %d closed before its hello was answered (%s)", hello.job, hello.rank, exc)
    return True

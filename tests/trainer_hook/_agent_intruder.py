"""An intruder for tests/trainer_hook/test_node_agent_trust.py: a process that is not the agent's
guest (another uid, or the same user) and tries what an attacker on a shared host would.
Standard library, websockets and rebalancer_wire only (no torch: it starts in a fraction of
a second). Prints one JSON line per attempt. The test runs it as a script (a process started
with ``LOCAL_RANK``) or, for another uid, calls ``as_user`` (a fork that drops to that uid: the
interpreter's files are root's alone here, so another uid could not start a new one).

Usage:
  python _agent_intruder.py plant DIR PATH...      bind and listen on each PATH (DIR made 0777 first),
                                                   print every handshake, answer with a redirect to
                                                   $SPY_URL and close 4307
  python _agent_intruder.py connect SOCK KEYFILE   try the agent at SOCK: without the secret, then
                                                   with it (when KEYFILE is readable) as another
                                                   local rank, then as its own (LOCAL_RANK), waiting
                                                   on stdin before it exits
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect
from websockets.sync.server import ServerConnection, unix_serve

from rebalancer_wire.protocol import Error, Hello, encode


def _say(**what: object) -> None:
    print(json.dumps(what), flush=True)


def as_user(uid: int, fn: Callable[..., None], *args: Any) -> tuple[int, IO[str]]:
    """Run ``fn(*args)`` in a child process of uid ``uid``; returns its pid and its output."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but the intruder's own code, then _exit
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            sys.stdout = os.fdopen(w, "w", buffering=1)
            sys.stdin = open(os.devnull)
            fn(*args)
        finally:
            os._exit(0)
    os.close(w)
    return pid, os.fdopen(r)


def plant(directory: str, paths: list[str]) -> None:
    if not os.path.exists(directory):  # came first: made it, open to all
        os.makedirs(directory)
        os.chmod(directory, 0o777)

    def serve(conn: ServerConnection) -> None:
        _say(event="handshake", path=conn.request.path if conn.request else "",
             headers=dict(conn.request.headers.raw_items()) if conn.request else {})
        try:
            first = conn.recv(timeout=5)
            _say(event="frame", text=first if isinstance(first, str) else first.decode())
        except Exception:  # noqa: BLE001
            pass
        conn.send(encode(Error(code="redirect", message=os.environ["SPY_URL"])))
        conn.close(4307, os.environ["SPY_URL"])

    servers = [unix_serve(serve, p) for p in paths]
    for p in paths:
        os.chmod(p, 0o777)
    for s in servers[1:]:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    _say(event="listening", uid=os.getuid())
    servers[0].serve_forever()


def _try(sock_path: str, headers: dict[str, str], hello: Hello | None) -> dict[str, object]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sock_path)
    except OSError as exc:
        return {"outcome": "connect", "error": type(exc).__name__}
    try:
        ws = connect("ws://localhost/ws/hook", sock=s, additional_headers=headers, open_timeout=5)
    except InvalidStatus as exc:
        return {"outcome": "http", "status": exc.response.status_code}
    if hello is None:
        return {"outcome": "open", "ws": ws}
    ws.send(encode(hello))
    try:
        reply = ws.recv(timeout=1)
        ws.recv(timeout=1)
    except TimeoutError:
        return {"outcome": "open", "ws": ws}
    except ConnectionClosed as exc:
        return {"outcome": "closed", "code": exc.rcvd.code if exc.rcvd else None, "reply": reply}
    return {"outcome": "open", "ws": ws}


def connect_as_guest(sock_path: str, key_path: str) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "1"))
    me = {"job": os.environ["JOB"], "world_size": 4, "global_batch_size": 16, "host": "n", "pid": os.getpid()}
    first = _try(sock_path, {}, None)  # no secret
    first.pop("ws", None)
    _say(attempt="no secret", **first)
    try:
        with open(key_path) as f:
            key = f.read().strip()
    except OSError as exc:
        _say(attempt="read secret", outcome="refused", error=type(exc).__name__)
        return
    header = {"X-Rebalancer-Launch-Key": key}
    other = _try(sock_path, header, Hello(rank=local_rank + 1, local_rank=local_rank + 1, **me))  # type: ignore[arg-type]
    other.pop("ws", None)
    _say(attempt="another local rank", **other)
    own = _try(sock_path, header, Hello(rank=local_rank, local_rank=local_rank, **me))  # type: ignore[arg-type]
    ws: Any = own.pop("ws", None)
    _say(attempt="own local rank", **own)
    sys.stdin.readline()
    if ws is not None:
        ws.close()


if __name__ == "__main__":
    if sys.argv[1] == "plant":
        plant(sys.argv[2], sys.argv[3:])
    else:
        connect_as_guest(sys.argv[2], sys.argv[3])

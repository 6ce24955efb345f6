"""The node agent's trust boundary: where its socket may live, who may talk to it.

A local rank's frames reach the backend through local rank 0's agent (trainer_hook/node_agg.py)
over a unix socket. On a shared host that socket must not be reachable by, or plantable by,
anyone but the job's user and its own launch:

- The socket and the launch's secret live in a directory only this user can enter:
  ``$REBALANCER_AGENT_DIR`` when a launcher made one, else ``$XDG_RUNTIME_DIR/rebalancer``,
  else ``<tmp>/rebalancer-<uid>``; created 0700, and a directory found there is used only when
  it is ours, a real directory (no symlink) and closed to group and others (``private_dir``).
  Anything else means "no agent": each rank connects on its own.
- Both ends check the peer's uid with ``SO_PEERCRED`` (``peer_credentials``).
- The agent writes a per-launch secret to a 0600 file beside its socket (``write_secret``);
  a guest proves it belongs to the launch by sending it in the handshake (``KEY_HEADER``).
- The kernel's pid of the peer names the process a hello must come from, and that process's
  ``LOCAL_RANK`` (as torchrun started it, ``/proc/<pid>/environ``) the only local rank it may
  speak for (``launch_local_rank``).
"""

from __future__ import annotations

import errno
import hmac
import os
import secrets
import socket
import stat
import struct
import tempfile
from collections.abc import Mapping

from websockets.sync.client import ClientConnection, connect

from rebalancer_wire.protocol import MAX_MESSAGE_BYTES
from trainer_hook._urls import WS_PATH

__all__ = ["AgentRefused", "ENV_AGENT_DIR", "KEY_HEADER", "NotPrivate", "connect_agent", "check_private_dir", "launch_local_rank",
           "peer_credentials", "private_dir", "read_secret", "same_secret", "secret_path", "write_secret"]

ENV_AGENT_DIR = "REBALANCER_AGENT_DIR"
KEY_HEADER = "X-Rebalancer-Launch-Key"
_SECRET_BYTES = 32


class NotPrivate(OSError):
    """A path the agent would use is not this user's alone (planted, or opened to others)."""


def check_private_dir(path: str) -> None:
    """Raises ``NotPrivate`` unless ``path`` is a real directory of this user, 0700 or closer."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NotPrivate(f"{path} is not a directory (a symlink or a file was planted there)")
    if st.st_uid != os.getuid():
        raise NotPrivate(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})")
    if st.st_mode & 0o077:
        raise NotPrivate(f"{path} has mode {stat.S_IMODE(st.st_mode):o}; only its owner may enter it (0700)")


def _make_private(path: str) -> str:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_private_dir(path)
    return path


def private_dir(env: Mapping[str, str]) -> str:
    """The directory for this user's agent sockets, made if missing; raises ``NotPrivate``
    (an ``OSError``) when what is there is not this user's alone."""
    given = env.get(ENV_AGENT_DIR, "").strip()
    if given:  # a launcher made it and passed it down: it must be private already
        if not os.path.isabs(given):
            raise NotPrivate(f"{ENV_AGENT_DIR} must be an absolute path, got {given!r}")
        check_private_dir(given)
        return given
    runtime = env.get("XDG_RUNTIME_DIR", "").strip()
    if runtime and os.path.isabs(runtime):
        try:
            check_private_dir(runtime)
        except OSError:
            pass  # unsafe or absent: the temporary directory below
        else:
            return _make_private(os.path.join(runtime, "rebalancer"))
    return _make_private(os.path.join(tempfile.gettempdir(), f"rebalancer-{os.getuid()}"))


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket, as the kernel says."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def secret_path(socket_path: str) -> str:
    """The launch's secret file beside the agent's socket."""
    return os.path.splitext(socket_path)[0] + ".key"


def write_secret(path: str) -> str:
    """A fresh per-launch secret in a new 0600 file at ``path`` (a stale one of ours replaced)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    value = secrets.token_hex(_SECRET_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value)
    return value


def read_secret(path: str) -> str:
    """The launch's secret; raises ``OSError`` while there is none (the agent has not started)
    and ``NotPrivate`` when the file is not this user's alone."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise NotPrivate(f"{path} is not a 0600 file of this user")
        value = f.read(2 * _SECRET_BYTES + 1).strip()
    if len(value) != 2 * _SECRET_BYTES:
        raise OSError(errno.EAGAIN, f"{path} holds no secret yet")
    return value


def same_secret(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def launch_local_rank(pid: int) -> int | None:
    """``LOCAL_RANK`` in the environment process ``pid`` was started with; None when it has
    none or it cannot be read (not Linux)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    for item in raw.split(b"\0"):
        if item.startswith(b"LOCAL_RANK="):
            try:
                return int(item[len(b"LOCAL_RANK="):])
            except ValueError:
                return None
    return None


class AgentRefused(Exception):
    """The node agent cannot be trusted or refused this rank: this rank uses its own connection."""


def connect_agent(path: str, *, open_timeout: float, close_timeout: float) -> ClientConnection:
    """A guest's websocket to its node agent at ``path``: the directory is this user's alone, the
    listener runs as this user, and only then does the launch's secret go to it (never the
    backend's token). ``AgentRefused`` otherwise; ``OSError`` while nobody listens."""
    sock = _agent_socket(path, open_timeout)
    try:
        secret = read_secret(secret_path(path))
    except NotPrivate as exc:
        sock.close()
        raise AgentRefused(str(exc)) from None
    except BaseException:
        sock.close()
        raise
    return connect("ws://localhost" + WS_PATH, sock=sock, additional_headers={KEY_HEADER: secret},
                   open_timeout=open_timeout, close_timeout=close_timeout, max_size=MAX_MESSAGE_BYTES,
                   compression=None)


def _agent_socket(path: str, timeout: float) -> socket.socket:
    """A connected unix socket to the node agent at ``path``, once its directory is this user's
    alone and the process listening runs as this user (``SO_PEERCRED``): only then may the
    launch's secret go to it. ``AgentRefused`` otherwise; ``OSError`` while nobody listens."""
    try:
        check_private_dir(os.path.dirname(path))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise AgentRefused(str(exc)) from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        pid, uid, _ = peer_credentials(sock)
    except BaseException:
        sock.close()
        raise
    if uid != os.getuid():
        sock.close()
        raise AgentRefused(f"pid {pid} listening on {path} runs as uid {uid}, not as this user (uid {os.getuid()})")
    return sock

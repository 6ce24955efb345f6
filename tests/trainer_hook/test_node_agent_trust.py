"""The node agent's trust boundary (issue 38), tried as an intruder on a shared host would:
a socket or directory planted by another user, a process of another uid, a same-user process
without the launch's secret, a guest saying hello as another local rank or process, an agent
that tries to redirect a rank. No backend: the agent and the ranks' transports are real, the
backend URLs lead nowhere or to a spy that records whatever reaches it.

The intruders are small processes (tests/trainer_hook/_agent_intruder.py; another uid with
``user=65534``: the tests run as root in the sandbox)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.server import ServerConnection, unix_serve

from rebalancer_wire.ports import free_port
from rebalancer_wire.protocol import Error, Hello, encode
from tests.helpers.waiting import wait_until
from tests.trainer_hook import _agent_intruder as intruder
from trainer_hook._agent_trust import KEY_HEADER, NotPrivate, private_dir, secret_path, write_secret
from trainer_hook.node_agg import NodeAgent, agent_path, make_transport

NOBODY = 65534
INTRUDER = str(Path(__file__).with_name("_agent_intruder.py"))
pytestmark = pytest.mark.multiproc
root_only = pytest.mark.skipif(os.getuid() != 0, reason="another uid needs root (the sandbox runs as root)")


class Spy:
    """A TCP listener that records the first bytes of every connection (a token sent there)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.got: list[bytes] = []
        self._sock = socket.create_server(("127.0.0.1", self.port))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    self.got.append(conn.recv(65536))
                except OSError:
                    self.got.append(b"")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory another uid can traverse (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="rb-trust-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def spy() -> Iterator[Spy]:
    s = Spy()
    yield s
    s.close()


def _env(job: str, local_rank: int, run: Path | None) -> dict[str, str]:
    env = {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": job,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GROUP_RANK": "0"}
    if run is not None:
        env["XDG_RUNTIME_DIR"] = str(run)
    return env


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    return run


def _hello(job: str, rank: int, pid: int | None = None) -> Any:
    return lambda: Hello(job=job, rank=rank, world_size=4, global_batch_size=16, local_rank=rank, host="n",
                         pid=os.getpid() if pid is None else pid)


def _intruder(args: list[str], *, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.environ.get("PYTHONPATH", os.getcwd()),
            **(env or {})}
    return subprocess.Popen([sys.executable, INTRUDER, *args], env=full, text=True, stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE, cwd=os.getcwd())


class _Other:
    """An intruder of another uid (a forked child: see _agent_intruder.as_user)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.pid, self.stdout = intruder.as_user(NOBODY, fn, *args)

    def kill(self) -> str:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
        return self.stdout.read()


@root_only
def test_a_planted_agent_gets_nothing_and_never_redirects_a_rank(shared: Path, spy: Spy,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    # Another user came first: the directory where this user's agent sockets go, and a socket
    # at the path a rank of the launch would use (the old one in the shared /tmp too), whose
    # owner answers with a redirect to a URL of its own. The rank must not send its hello or
    # its Bearer token anywhere but its own backend.
    tmp = shared / "shared-tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    job = "planted"
    env = _env(job, 1, None)
    key = "\0".join([job, job, "127.0.0.1", "29500", "0", ""])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    planted_dir = tmp / f"rebalancer-{os.getuid()}"
    paths = [str(planted_dir / f"{digest}.sock"), str(tmp / f"rebalancer-{os.getuid()}-{digest}.sock")]
    monkeypatch.setenv("SPY_URL", f"http://127.0.0.1:{spy.port}")
    attacker = _Other(intruder.plant, str(planted_dir), paths)
    out = ""
    try:
        assert json.loads(attacker.stdout.readline()) == {"event": "listening", "uid": NOBODY}
        assert planted_dir.stat().st_uid == NOBODY
        own = free_port()  # the rank's own backend: nobody listens there
        caplog.set_level(logging.WARNING)
        t = make_transport(job=job, url=f"http://127.0.0.1:{own}", token="rb_hook_secret_token",
                           hello=_hello(job, 1), on_message=lambda m: None, env=env, local_agent_wait_s=0.5,
                           backoff_initial_s=0.05, backoff_max_s=0.1)
        t.start()
        try:
            wait_until(lambda: t.url == f"ws://127.0.0.1:{own}/ws/hook", "the rank on its own connection", 10)
            time.sleep(1.0)  # a rank that follows the redirect reaches the spy within this
        finally:
            t.close(timeout=0.5)
        assert spy.got == [], "the rank sent something to the URL the planted socket named"
        assert t.urls == [f"ws://127.0.0.1:{own}/ws/hook"]
        said = [r.getMessage() for r in caplog.records if r.name.startswith("trainer_hook")]
        assert any(m.startswith("No node agent: ") and "belongs to uid 65534" in m for m in said), said
    finally:
        out = attacker.kill()
    assert "handshake" not in out, out


def test_directories_that_are_not_this_users_alone_are_refused(tmp_path: Path, shared: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    # $XDG_RUNTIME_DIR when it is private; one that others may enter is passed over (a short one:
    # an agent's socket path must fit a unix socket's 107 bytes)
    run = _run_dir(shared)
    assert private_dir({"XDG_RUNTIME_DIR": str(run)}) == str(run / "rebalancer")
    assert (run / "rebalancer").stat().st_mode & 0o777 == 0o700
    opened = tmp_path / "opened"
    opened.mkdir()
    opened.chmod(0o755)
    assert private_dir({"XDG_RUNTIME_DIR": str(opened)}) == str(tmp / f"rebalancer-{os.getuid()}")
    # a directory opened to others, a symlink planted in its place: no agent
    (tmp / f"rebalancer-{os.getuid()}").chmod(0o755)
    with pytest.raises(NotPrivate, match="has mode 755; only its owner may enter it"):
        private_dir({})
    (tmp / f"rebalancer-{os.getuid()}").rmdir()
    (tmp / f"rebalancer-{os.getuid()}").symlink_to(run)
    with pytest.raises(NotPrivate, match="is not a directory"):
        private_dir({})
    given = tmp_path / "given"
    given.mkdir(mode=0o700)
    given.chmod(0o770)
    with pytest.raises(NotPrivate, match="has mode 770"):
        private_dir({"REBALANCER_AGENT_DIR": str(given)})
    # local rank 0 under such a directory: one warning, no agent, its own connection
    caplog.set_level(logging.WARNING)
    t = make_transport(job="j", url="http://127.0.0.1:9", token=None, hello=_hello("j", 0),
                       on_message=lambda m: None, env={**_env("j", 0, None), "REBALANCER_AGENT_DIR": str(given)})
    assert t.relay is None and t.urls == ["ws://127.0.0.1:9/ws/hook"]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and said[0].startswith("No node agent: ") and "REBALANCER_AGENT_DIR" in said[0], said
    # a path in a private directory taken by something that is not our old socket: no agent
    path = agent_path("j", _env("j", 0, run))
    Path(path).write_text("not a socket")
    with pytest.raises(NotPrivate, match="is taken by something"):
        NodeAgent(job="j", path=path).start()


@pytest.fixture
def agent(shared: Path) -> Iterator[NodeAgent]:
    a = NodeAgent(job="trust", path=agent_path("trust", _env("trust", 0, _run_dir(shared))), local_world_size=4)
    a.start()
    yield a
    a.stop("test over")


def _frames(agent: NodeAgent) -> list[dict[str, Any]]:
    with agent._lock:  # noqa: SLF001 - what waits to go upstream
        return [json.loads(text) for _, text, _ in agent._waiting]  # noqa: SLF001


def test_the_agent_admits_its_launchs_guests_only_each_as_itself(agent: NodeAgent, tmp_path: Path) -> None:
    key = secret_path(agent.path)
    assert Path(key).stat().st_mode & 0o777 == 0o600 and Path(agent.path).stat().st_mode & 0o777 == 0o600
    assert Path(agent.path).parent.stat().st_mode & 0o777 == 0o700
    # A same-user process that does not know the secret; then one started by torchrun as local
    # rank 1 that knows it, saying hello as local rank 2, then as itself.
    guest = _intruder(["connect", agent.path, key], env={"LOCAL_RANK": "1", "JOB": "trust"})
    try:
        assert guest.stdout is not None and guest.stdin is not None
        said = [json.loads(guest.stdout.readline()) for _ in range(3)]
        assert said[0] == {"attempt": "no secret", "outcome": "http", "status": 403}
        assert said[1]["attempt"] == "another local rank" and said[1]["code"] == 4403, said
        assert json.loads(said[1]["reply"])["message"] == (
            f"Process {guest.pid} was started as local rank 1; it may not say hello as local rank 2.")
        assert said[2] == {"attempt": "own local rank", "outcome": "open"}, said
        wait_until(lambda: agent.guests == [1], "the guest admitted as itself")
        # Another process (this one) may not take local rank 1 over, nor speak as another pid.
        for hello, why in (
            (_hello("trust", 1)(), f"Local rank 1 speaks from pid {guest.pid} as rank 1"),
            (_hello("trust", 2, pid=guest.pid)(), f"this hello says pid {guest.pid}, the connection is from pid"),
            (Hello(job="trust", rank=1, world_size=4, global_batch_size=16, local_rank=2, host="n",
                   pid=os.getpid()), "Rank 1 is local rank 1's; local rank 2 may not say hello as it."),
            (_hello("trust", 0)(), "A guest of this node agent is local rank 1 to 3; this hello says local rank 0."),
        ):
            code, reply = _say_hello(agent, hello)
            assert code == 4403 and why in reply["message"], (reply, why)
        guest.stdin.write("\n")
        guest.stdin.flush()
    finally:
        guest.wait(10)
    wait_until(lambda: agent.guests == [], "the guest gone")
    assert [(f["type"], f["rank"]) for f in _frames(agent)] == [("hello", 1), ("leave", 1)]


def _say_hello(agent: NodeAgent, hello: Hello) -> tuple[int | None, dict[str, Any]]:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(agent.path)
    key = Path(secret_path(agent.path)).read_text()
    with connect("ws://localhost/ws/hook", sock=s, additional_headers={KEY_HEADER: key}) as ws:
        ws.send(encode(hello))
        reply = json.loads(ws.recv(timeout=5))
        try:
            ws.recv(timeout=5)
        except ConnectionClosed as exc:
            return (exc.rcvd.code if exc.rcvd else None), reply
    return None, reply


@root_only
def test_another_uid_is_refused_by_the_agent(agent: NodeAgent) -> None:
    # Even where it can reach the socket (its directory opened by mistake), and holding the
    # secret, a process of another uid is refused on its peer credentials.
    directory = Path(agent.path).parent
    for d in (directory, directory.parent):
        d.chmod(0o755)
    Path(agent.path).chmod(0o666)
    key = Path(secret_path(agent.path))
    key.chmod(0o644)
    os.environ["JOB"] = "trust"
    try:
        other = _Other(intruder.connect_as_guest, agent.path, str(key))
        said = [json.loads(other.stdout.readline()) for _ in range(3)]
        other.kill()
    finally:
        for d in (directory, directory.parent):
            d.chmod(0o700)
        del os.environ["JOB"]
    assert said[0] == {"attempt": "no secret", "outcome": "http", "status": 403}, said
    assert said[1] == {"attempt": "another local rank", "outcome": "http", "status": 403}, said
    assert said[2] == {"attempt": "own local rank", "outcome": "http", "status": 403}, said
    assert agent.guests == [] and _frames(agent) == []


def _rank_gives_up_on_the_agent(job: str, env: dict[str, str]) -> None:
    """Rank 1 of ``job`` under ``env`` drops the node agent there and dials its own backend
    itself (a closed port: nothing is sent anywhere)."""
    own = free_port()
    t = make_transport(job=job, url=f"http://127.0.0.1:{own}", token="rb_hook_secret_token", hello=_hello(job, 1),
                       on_message=lambda m: None, env=env, backoff_initial_s=0.05)
    t.start()
    try:
        wait_until(lambda: t.urls == [f"ws://127.0.0.1:{own}/ws/hook"], "the rank gave up on that agent", 10)
    finally:
        t.close(timeout=0.5)


@root_only
def test_a_rank_checks_who_listens_before_it_sends_the_secret(shared: Path, spy: Spy,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    # Another uid listens at the agent's path inside this user's private directory (opened by
    # mistake while it bound): the rank sees the listener's uid and never sends a byte.
    run = _run_dir(shared)
    env = _env("peer", 1, run)
    path = agent_path("peer", env)
    write_secret(secret_path(path))
    run.chmod(0o755)
    Path(path).parent.chmod(0o777)  # opened by mistake while the intruder binds
    os.environ["SPY_URL"] = f"http://127.0.0.1:{spy.port}"
    attacker = _Other(intruder.plant, str(Path(path).parent), [path])
    out = ""
    try:
        assert json.loads(attacker.stdout.readline())["event"] == "listening"
        Path(path).parent.chmod(0o700)
        run.chmod(0o700)
        caplog.set_level(logging.WARNING)
        _rank_gives_up_on_the_agent("peer", env)
    finally:
        out = attacker.kill()
        del os.environ["SPY_URL"]
    assert "handshake" not in out, out
    said = [r.getMessage() for r in caplog.records if r.name == "trainer_hook.transport"]
    assert any("runs as uid 65534, not as this user" in m for m in said), said
    assert spy.got == []


def test_a_redirect_from_the_agent_is_never_followed(shared: Path, spy: Spy,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    # A same-user agent (buggy or not ours) answers a rank's hello with a redirect: the rank
    # ignores it and connects on its own; its token goes nowhere else. (A short directory: under
    # pytest-xdist tmp_path is longer than a unix socket's 107-byte path.)
    run = _run_dir(shared)
    env = _env("redir", 1, run)
    path = agent_path("redir", env)
    write_secret(secret_path(path))
    seen: list[str] = []

    def serve(conn: ServerConnection) -> None:
        seen.append(str(conn.recv(timeout=5)))
        conn.send(encode(Error(code="redirect", message=f"http://127.0.0.1:{spy.port}")))
        conn.close(4307, f"http://127.0.0.1:{spy.port}")

    server = unix_serve(serve, path)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    caplog.set_level(logging.WARNING)
    try:
        _rank_gives_up_on_the_agent("redir", env)
    finally:
        server.shutdown()
    assert len(seen) == 1 and spy.got == []
    said = [r.getMessage() for r in caplog.records if r.name == "trainer_hook.transport"]
    assert any(m.startswith("Ignoring a redirect to ") for m in said), said


def test_a_private_directory_too_deep_for_a_unix_socket_means_no_agent(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir(mode=0o700)
    caplog.set_level(logging.WARNING)
    t = make_transport(job="deep", url="http://127.0.0.1:9", token=None, hello=_hello("deep", 1),
                       on_message=lambda m: None, env=_env("deep", 1, deep))
    assert t.relay is None and t.urls == ["ws://127.0.0.1:9/ws/hook"]
    said = [r.getMessage() for r in caplog.records if r.name == "trainer_hook.node_agg"]
    assert len(said) == 1 and "longer than the 107 bytes a unix socket allows" in said[0], said

"""Free loopback ports for the processes Rebalancer starts itself: the backend of `rebalancer
demo` and `rebalancer run`, torchrun's rendezvous in the demo and in ``notebook_launch``, the
benchmarks' and the tests' servers.

A port from ``bind(("127.0.0.1", 0))`` comes from the kernel's ephemeral range, the range it
also takes every outgoing connection's local port from. Between closing that probe and the
server's own bind, any connection made on the machine (a rank's gloo pair, an HTTP client, a
websocket) may take the port, and the server fails with "address already in use" (a backend of
the test suite did, on a loaded 2-core machine). So ports come from below that range, where the
kernel never picks one by itself; at random, and probed, so that callers running at the same
time rarely pick the same one."""

from __future__ import annotations

import random
import socket

__all__ = ["LOWEST", "ephemeral_range", "free_port", "port_free"]

LOWEST = 20000  # above the service ports in common use (PostgreSQL 5432, Redis 6379, NATS 4222, 8080...)
_TRIES = 64
_random = random.SystemRandom()  # not the caller's seeded ``random``: concurrent callers must differ


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range for ports it picks itself (Linux's default where it cannot be read)."""
    try:
        with open(path, encoding="ascii") as f:
            lo, hi = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return 32768, 60999
    return lo, hi


def port_free(port: int) -> bool:
    """True when ``port`` on 127.0.0.1 can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing uses right now and that the kernel does not hand
    out to outgoing connections (below its ephemeral range); a kernel-picked port only when
    that range starts too low to leave a thousand ports above ``LOWEST`` or none is free there."""
    lo, _ = ephemeral_range()
    if lo - LOWEST >= 1000:
        for _ in range(_TRIES):
            port = _random.randrange(LOWEST, lo)
            if port_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

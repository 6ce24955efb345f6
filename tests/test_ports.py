"""Free ports for the servers and rendezvous Rebalancer starts (``rebalancer_wire.ports``).

A test backend failed in CI with "address already in use": its port came from bind(0), the
kernel's ephemeral range, which it also hands to every outgoing connection; one took the
port between the pick and the server's bind. Ports now come from below that range, and the
test helper starts the server again on another port when its bind still fails."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from backend import process
from rebalancer_wire import ports
from rebalancer_wire.ports import LOWEST, ephemeral_range, free_port, port_free
from tests.helpers import server as server_helper


def test_an_outgoing_connection_takes_its_port_from_the_range_free_port_stays_below() -> None:
    lo, hi = ephemeral_range()
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname()) as client:
        assert lo <= client.getsockname()[1] <= hi  # what bind(0) used to race with
    picked = {free_port() for _ in range(50)}
    assert all(LOWEST <= p < lo for p in picked)
    assert all(port_free(p) for p in picked)
    assert len(picked) > 40  # at random: concurrent callers rarely meet


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as held:
        taken = held.getsockname()[1]
        assert not port_free(taken)
        free = free_port()
        picks = iter([taken, taken, free])
        monkeypatch.setattr(ports._random, "randrange", lambda a, b: next(picks))
        assert free_port() == free


def test_a_low_ephemeral_range_or_no_free_candidate_falls_back_to_a_kernel_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (20500, 60999))  # under 1000 ports below it
    assert free_port() >= 20500
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (32768, 60999))
    monkeypatch.setattr(ports, "port_free", lambda port: False)
    assert free_port() >= 32768


def test_the_range_is_read_from_the_kernel_with_linuxs_default_when_it_cannot_be(tmp_path: Path) -> None:
    (tmp_path / "range").write_text("40000\t50000\n")
    assert ephemeral_range(str(tmp_path / "range")) == (40000, 50000)
    (tmp_path / "bad").write_text("forty\n")
    assert ephemeral_range(str(tmp_path / "bad")) == (32768, 60999)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


@pytest.mark.multiproc
def test_a_test_backend_whose_port_was_taken_starts_again_on_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as held:
        taken = held.getsockname()[1]
        picks = iter([taken])
        monkeypatch.setattr(process, "free_port", lambda: next(picks, None) or free_port())
        with server_helper.running_server(tmp_path) as srv:
            assert srv.port != taken
            assert srv.get("/healthz")
        assert process.ADDRESS_IN_USE in (tmp_path / f"server-{taken}.log").read_text()

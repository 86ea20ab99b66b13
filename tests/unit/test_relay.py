"""The relay (`diloco.swarm.relay`): real TCP on loopback between a real `Relay`, ranks' `Lease`s and callers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from diloco.swarm.relay import lease as lease_module
from diloco.swarm.relay import protocol
from diloco.swarm.relay import server as server_module
from diloco.swarm.relay.lease import Lease, forward_to
from diloco.swarm.relay.server import Relay
from diloco.swarm.rounds.frames import recv_exact


def free_ports(count: int) -> list[int]:
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    try:
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture
def relay() -> Iterator[Relay]:
    control, *ports = free_ports(5)
    started = Relay("127.0.0.1", control, ports).start()
    try:
        yield started
    finally:
        started.close()


def at(relay: Relay) -> tuple[list[str], int]:
    return (["127.0.0.1"], relay.control_port)


class Taken:
    """A target that keeps what it is handed."""

    def __init__(self) -> None:
        self.conns: list[tuple[socket.socket, str]] = []
        self.cv = threading.Condition()

    def __call__(self, conn: socket.socket, caller: str) -> None:
        with self.cv:
            self.conns.append((conn, caller))
            self.cv.notify_all()

    def wait(self, count: int, timeout: float = 10.0) -> list[tuple[socket.socket, str]]:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.conns) >= count, timeout), f"{len(self.conns)} of {count}"
            return list(self.conns)


def read(sock: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    recv_exact(sock, memoryview(data), time.monotonic() + 10)
    return bytes(data)


def test_a_connection_at_a_leased_port_reaches_the_lease_holder_both_ways(relay: Relay) -> None:
    taken = Taken()
    held = Lease(at(relay), [taken])
    try:
        assert held.host == "127.0.0.1" and held.observed == "127.0.0.1" and held.alive
        payload = bytes(range(256)) * 8192  # 2 MiB: more than one read's chunk each way
        with socket.create_connection((held.host, held.ports[0]), timeout=10) as caller:
            caller.sendall(b"hello")
            (conn, seen), = taken.wait(1)
            assert seen == "127.0.0.1" and read(conn, 5) == b"hello"
            sender = threading.Thread(target=conn.sendall, args=(payload,))
            sender.start()
            assert read(caller, len(payload)) == payload
            sender.join()
            caller.sendall(payload)
            assert read(conn, len(payload)) == payload
            caller.shutdown(socket.SHUT_WR)  # the end of one direction passes through
            conn.settimeout(10)
            assert conn.recv(1) == b""
            conn.close()
            caller.settimeout(10)
            assert caller.recv(1) == b""
    finally:
        held.close()


def test_each_of_two_ports_goes_to_its_own_target_and_a_forward_reaches_a_local_server(relay: Relay) -> None:
    local = socket.create_server(("127.0.0.1", 0))
    taken = Taken()
    held = Lease(at(relay), [taken, forward_to(local.getsockname()[1])])
    try:
        assert len(set(held.ports)) == 2
        with socket.create_connection((held.host, held.ports[1]), timeout=10) as caller:
            caller.sendall(b"to the daemon")
            local.settimeout(10)
            inner, _ = local.accept()
            assert read(inner, 13) == b"to the daemon"
            inner.sendall(b"back")
            assert read(caller, 4) == b"back"
            inner.close()
        assert taken.conns == []
    finally:
        held.close()
        local.close()


def test_ports_are_leased_while_the_control_connection_lasts_and_a_stranger_takes_nothing(relay: Relay) -> None:
    first = Lease(at(relay), [Taken(), Taken()])
    second = Lease(at(relay), [Taken(), Taken()])
    assert not set(first.ports) & set(second.ports)
    with pytest.raises(ConnectionError, match="port"):  # four ports leased of four
        Lease(at(relay), [Taken()])
    port = first.ports[0]
    first.close()
    deadline = time.monotonic() + 10
    while True:  # its ports are free again once the relay saw it leave
        try:
            third = Lease(at(relay), [Taken()], want=[port])
            break
        except ConnectionError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert third.ports == [port]  # the port asked for, when free
    # a stranger who guesses no id gets nothing: the waiting connection still goes to the lease's holder
    with socket.create_connection(("127.0.0.1", relay.control_port), timeout=10) as stranger:
        stranger.sendall(protocol.DATA + bytes(protocol.ID_SIZE))
        stranger.settimeout(10)
        assert stranger.recv(1) == b""
    second.close()
    third.close()


@pytest.mark.parametrize("request_bytes", [
    b"GET / HTTP/1.1\r\n\r\n",
    protocol.LEASE + b"\x00\x05[1,2]",
    protocol.LEASE + b'\x00\x0c{"count":99}',
    protocol.LEASE + b"\xff\xff",
])  # fmt: skip
def test_malformed_requests_lease_nothing(relay: Relay, request_bytes: bytes) -> None:
    with socket.create_connection(("127.0.0.1", relay.control_port), timeout=10) as stranger:
        stranger.sendall(request_bytes)
        stranger.settimeout(10)
        assert stranger.recv(64) == b""  # closed without an answer
    held = Lease(at(relay), [Taken()] * 4)  # every port still free
    held.close()


def test_a_relay_that_goes_away_and_returns_grants_the_same_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lease_module, "RETRY_S", 0.2)
    control, *ports = free_ports(3)
    relay = Relay("127.0.0.1", control, ports).start()
    taken = Taken()
    held = Lease((["127.0.0.1"], control), [taken])
    try:
        relay.close()
        deadline = time.monotonic() + 10
        while held.alive:
            assert time.monotonic() < deadline, "the lease did not see its relay go"
            time.sleep(0.05)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", held.ports[0]), timeout=2)
        relay = Relay("127.0.0.1", control, list(reversed(ports))).start()  # another order: the port asked wins
        while not held.alive:
            assert time.monotonic() < deadline + 10, "the lease did not come back"
            time.sleep(0.05)
        with socket.create_connection(("127.0.0.1", held.ports[0]), timeout=10) as caller:
            caller.sendall(b"again")
            (conn, _), = taken.wait(1)
            assert read(conn, 5) == b"again"
            conn.close()
    finally:
        held.close()
        relay.close()


def test_a_connection_nobody_fetches_is_closed_after_its_wait(relay: Relay, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "PENDING_S", 0.5)
    monkeypatch.setattr(Lease, "_fetch", lambda *args: None)  # a rank that never fetches
    held = Lease(at(relay), [Taken()])
    try:
        with socket.create_connection((held.host, held.ports[0]), timeout=10) as caller:
            caller.settimeout(10)
            assert caller.recv(1) == b""
    finally:
        held.close()


def test_idle_connections_at_the_control_port_are_capped_and_a_held_lease_is_not_one(
        relay: Relay, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Connections that have not sent their first bytes hold a thread each: past ``MAX_OPENING`` of them, a new one
    is closed at once. A lease, once answered, no longer counts: a rank keeps its control connection for hours."""
    monkeypatch.setattr(server_module, "MAX_OPENING", 1)
    held = Lease(at(relay), [Taken()])
    try:
        with socket.create_connection(("127.0.0.1", relay.control_port), timeout=10):
            time.sleep(0.2)  # (accepted, and waiting for its first bytes)
            with socket.create_connection(("127.0.0.1", relay.control_port), timeout=10) as flood:
                flood.settimeout(2)  # well before the 5 s hello timeout
                assert flood.recv(1) == b""
        deadline = time.monotonic() + 10
        while True:  # the idle one gone, a rank gets its lease again
            try:
                Lease(at(relay), [Taken()]).close()
                break
            except ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        held.close()

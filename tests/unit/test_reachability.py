"""Dial-back (`diloco.swarm.rounds.reachability`): a rank is direct only when a probe reached its own listener.

The requests travel as they do between a rank's DHT process and a serving peer's, minus libp2p: the stand-in DHT runs
the rank's request coroutine on an event loop of its own, and its "stream" is a socket pair whose other end the real
``DialBack`` handler answers; the dial-backs are real TCP connections on loopback to a real ``Listener``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from multiaddr import Multiaddr

from diloco.swarm.rounds import reachability
from diloco.swarm.rounds.listener import Listener, listen_socket
from diloco.swarm.rounds.reachability import DIRECT, OUTBOUND, UNCHECKED, DialBack, Probes, check, peer_ids

SEEN_FROM = "/ip4/203.0.113.7/tcp/4001"  # where the serving peer sees the asking rank's connection come from


class StandInP2P:
    """``call_binary_stream_handler`` as p2pd offers it: a stream to a peer whose handler is `handler`."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.asked: list[str] = []

    async def call_binary_stream_handler(self, peer, protocol: str):
        assert protocol == reachability.PROTOCOL
        self.asked.append(peer.to_base58())
        mine, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=mine)
        their_reader, their_writer = await asyncio.open_connection(sock=theirs)
        info = SimpleNamespace(addr=Multiaddr(SEEN_FROM))
        asyncio.ensure_future(self.handler(info, their_reader, their_writer))
        return info, reader, writer


class StandInDHT:
    """``run_coroutine(fn)``: fn(dht, node) on a loop of its own (the DHT process's), its result returned."""

    def __init__(self, handler=None, fails: bool = False) -> None:
        self.p2p = StandInP2P(handler or DialBack().answer)
        self.fails = fails

    def run_coroutine(self, fn):
        if self.fails:
            raise TimeoutError("no answer")
        return asyncio.run(fn(self, SimpleNamespace(p2p=self.p2p)))


PEER = "QmSVwbkziwwxWoBVxKF4gacwv7fNxjA5pf3dcTfKeNj4uu"


@pytest.fixture
def listening() -> Iterator[tuple[Listener, Probes, int]]:
    sock = listen_socket("127.0.0.1", 0)
    listener = Listener(sock, handshake_timeout=5.0).start()
    probes = Probes()
    listener.serve(reachability.MAGIC, probes)
    try:
        yield listener, probes, sock.getsockname()[1]
    finally:
        listener.close()


def test_a_rank_whose_listener_the_peer_reaches_is_direct(listening) -> None:
    _, probes, port = listening
    reach = check(StandInDHT(), [PEER], (["127.0.0.1"], port), probes)
    assert reach.kind == DIRECT and reach.dialable, reach
    assert "127.0.0.1" in reach.detail


def test_strangers_probes_are_answered_and_kept_nowhere(listening) -> None:
    """Probes of nonces this rank does not await (a stranger's, by the hundred) leave no trace and do not keep its
    own from counting."""
    _, probes, port = listening
    for i in range(100):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(reachability.MAGIC + i.to_bytes(reachability.NONCE_SIZE, "big"))
            assert conn.recv(1) == reachability.ACK
    assert probes._awaited == {}
    assert check(StandInDHT(), [PEER], (["127.0.0.1"], port), probes).kind == DIRECT
    assert probes._awaited == {}


def test_a_rank_nobody_reaches_is_outbound_only_and_hears_where_it_is_seen(listening) -> None:
    _, probes, port = listening
    reach = check(StandInDHT(), [PEER], (["127.0.0.2"], port), probes)  # (the listener is on 127.0.0.1 only)
    assert reach.kind == OUTBOUND and not reach.dialable, reach
    assert "127.0.0.2" in reach.detail and "203.0.113.7" in reach.detail


def test_something_else_at_the_address_or_a_peer_that_lies_does_not_make_a_rank_direct(listening) -> None:
    """An answer that says 'reached' proves nothing: only the nonce arriving at this rank's own listener does."""
    _, probes, _ = listening
    impostor = socket.create_server(("127.0.0.1", 0))  # acks any probe, but it is not this rank's listener
    acked = []

    def serve() -> None:
        conn, _ = impostor.accept()
        with conn:
            acked.append(conn.recv(64))
            conn.sendall(reachability.ACK)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        reach = check(StandInDHT(), [PEER], (["127.0.0.1"], impostor.getsockname()[1]), probes)
        assert reach.kind == OUTBOUND, reach
        thread.join(5)
        assert acked and acked[0].startswith(reachability.MAGIC)
    finally:
        impostor.close()

    async def liar(_info, reader, writer) -> None:
        await reachability._read(reader)
        writer.write(reachability._framed({"reached": ["127.0.0.1"], "observed": ""}))
        await writer.drain()
        writer.close()

    assert check(StandInDHT(liar), [PEER], (["127.0.0.1"], 1234), probes).kind == OUTBOUND

    async def noisy(_info, reader, writer) -> None:  # what it says is quoted in the rank's log: only what is ours
        await reachability._read(reader)
        writer.write(reachability._framed({"reached": ["\x1b[2J" * 50], "observed": "\x1b[2J evil"}))
        await writer.drain()
        writer.close()

    reach = check(StandInDHT(noisy), [PEER], (["127.0.0.1"], 1234), probes)
    assert reach.kind == OUTBOUND and "\x1b" not in reach.detail and "evil" not in reach.detail, reach


def test_no_peer_that_answers_leaves_the_rank_unchecked_and_dialable(listening) -> None:
    _, probes, port = listening
    reach = check(StandInDHT(fails=True), [PEER, PEER[:-1] + "v"], (["127.0.0.1"], port), probes)
    assert reach.kind == UNCHECKED and reach.dialable
    assert check(StandInDHT(), [], (["127.0.0.1"], port), probes).kind == UNCHECKED


def test_the_next_initial_peer_is_asked_when_one_does_not_answer(listening) -> None:
    _, probes, port = listening
    answering = StandInDHT()
    calls = []

    def run_coroutine(fn):
        calls.append(fn)
        if len(calls) == 1:
            raise ConnectionError("no route")
        return StandInDHT.run_coroutine(answering, fn)

    dht = SimpleNamespace(run_coroutine=run_coroutine)
    assert check(dht, [PEER, PEER[:-1] + "v"], (["127.0.0.1"], port), probes).kind == DIRECT
    assert len(calls) == 2


@pytest.mark.parametrize("request_", [
    {"hosts": ["example.com"], "port": 4000},  # names, not addresses: no lookups for strangers
    {"hosts": ["127.0.0.1"], "port": 22},  # privileged ports
    {"hosts": ["127.0.0.1"], "port": True},
    {"hosts": ["127.0.0.1"] * 9, "port": 4000},  # too many hosts
    {"hosts": [], "port": 4000},
    {"hosts": "127.0.0.1", "port": 4000},
    {"hosts": ["127.0.0.1"], "port": 4000, "nonce": "00"},
], ids=["name", "port-22", "bool-port", "nine-hosts", "no-hosts", "string-hosts", "short-nonce"])
def test_a_malformed_request_dials_nobody_and_gets_no_answer(request_: dict, monkeypatch) -> None:
    request_.setdefault("nonce", "ab" * reachability.NONCE_SIZE)
    dialled = []
    monkeypatch.setattr(reachability, "_dial", lambda *a: dialled.append(a))

    async def ask() -> bytes:
        mine, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=mine)
        their_reader, their_writer = await asyncio.open_connection(sock=theirs)
        writer.write(reachability._framed(request_))
        await writer.drain()
        await DialBack().answer(SimpleNamespace(addr=Multiaddr(SEEN_FROM)), their_reader, their_writer)
        return await reader.read()

    assert asyncio.run(ask()) == b"" and dialled == []


def test_an_oversized_request_is_not_read() -> None:
    async def ask() -> bytes:
        mine, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=mine)
        their_reader, their_writer = await asyncio.open_connection(sock=theirs)
        data = json.dumps({"hosts": ["127.0.0.1"] * 2000}).encode()
        writer.write(len(data).to_bytes(2, "big") + data)
        await writer.drain()
        await DialBack().answer(SimpleNamespace(addr=None), their_reader, their_writer)
        return await reader.read()

    assert asyncio.run(ask()) == b""


def test_peer_ids_come_from_the_p2p_part_of_each_initial_peer_once() -> None:
    assert peer_ids([f"/ip4/10.0.0.1/tcp/31337/p2p/{PEER}", f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER}",
                     "/ip4/10.0.0.2/tcp/1"]) == [PEER]  # fmt: skip


def test_a_rank_outbound_only_asks_on_until_a_peer_offers_a_relay(listening) -> None:
    """The first peer that answers gives the verdict; one without a relay is not the last asked when the rank cannot
    be dialled: the next peer's offer (its control port) comes with the first peer's verdict."""
    _, probes, port = listening
    offering = StandInDHT(DialBack(relay_port=41000).answer)
    plain = StandInDHT()
    calls = []

    def run_coroutine(fn):
        calls.append(fn)
        return StandInDHT.run_coroutine(plain if len(calls) == 1 else offering, fn)

    other = PEER[:-1] + "v"
    reach = check(SimpleNamespace(run_coroutine=run_coroutine), [PEER, other], (["127.0.0.2"], port), probes)
    assert reach.kind == OUTBOUND and reach.relay == (other, 41000) and PEER[-8:] in reach.detail, reach
    assert len(calls) == 2
    # a direct rank is not sent on asking: it needs no relay
    direct = check(StandInDHT(), [PEER, other], (["127.0.0.1"], port), probes)
    assert direct.kind == DIRECT and direct.relay is None


@pytest.mark.parametrize("offer", [0, 70000, "41000", True, None], ids=str)
def test_a_relay_offer_that_is_no_port_is_no_offer(listening, offer) -> None:
    _, probes, port = listening

    async def odd(_info, reader, writer) -> None:
        await reachability._read(reader)
        writer.write(reachability._framed({"reached": [], "observed": "", "relay": offer}))
        await writer.drain()
        writer.close()

    assert check(StandInDHT(odd), [PEER], (["127.0.0.2"], port), probes).relay is None


def test_a_relay_is_dialled_at_the_hosts_its_initial_peer_multiaddrs_name() -> None:
    other = PEER[:-1] + "v"
    maddrs = [f"/ip4/10.0.0.1/tcp/31337/p2p/{PEER}", f"/ip4/10.0.0.9/tcp/1/p2p/{other}",
              f"/dns4/relay.example.org/tcp/31337/p2p/{PEER}", f"/ip4/10.0.0.1/udp/9/quic/p2p/{PEER}"]  # fmt: skip
    assert reachability.hosts_of(maddrs, PEER) == ["10.0.0.1", "relay.example.org"]
    assert reachability.hosts_of(maddrs, "QmNobody") == []

"""Whether other peers can dial this rank's listener, learnt at join instead of guessed.

A rank asks a DHT peer it knows (its initial peers) to dial it back: over libp2p, which works from behind a home
router, it sends the TCP endpoint it is about to announce and a fresh nonce; the peer dials each announced host at
that port and sends the nonce there. The rank is ``direct`` when its own listener received the nonce: someone
outside reached this very listener, not just anything at that address. Otherwise it is ``outbound only``: it dials
out to the others and is never dialled (a round plans no span for it to reduce, as hivemind's client mode). With no
peer that answers (a swarm's first peer, a bootstrap peer of an earlier version) it stays ``unchecked`` and is
treated as dialable, as before.

The peer's side (``serve``) runs in its DHT process, registered on its p2pd daemon as the libp2p protocol
``PROTOCOL``: ``diloco dht`` serves it, and so does every rank found ``direct``. What a stranger can make it do is
bounded: a few hosts per request, one port of at least 1024, the nonce's bytes only, a few seconds each, a few
requests at once.

hivemind is pinned to 1.1.12; this relies on ``DHT.run_coroutine``, ``DHTNode.p2p`` and ``P2P``'s
``add_binary_stream_handler`` and ``call_binary_stream_handler`` (the stream's info carries the remote ``addr``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from diloco.swarm.records.addresses import ips
from diloco.swarm.rounds.frames import recv_exact

log = logging.getLogger("diloco")

PROTOCOL = "/diloco/dialback/1"
MAGIC = b"DLRB"  # a dial-back connection's first four bytes (``Listener.serve``), then the nonce
NONCE_SIZE = 16
ACK = b"\x01"
DIAL_TIMEOUT_S = 3.0  # per host the peer dials
ASK_TIMEOUT_S = 20.0  # a whole request, as the asking rank waits for it
ARRIVAL_WAIT_S = 2.0  # how long the nonce may take to show up at the listener after the peer said it reached it
MAX_HOSTS = 8
MAX_MESSAGE = 4096
AT_ONCE = 8  # requests a serving peer dials for at once; more wait

DIRECT, OUTBOUND, UNCHECKED = "direct", "outbound only", "unchecked"
RELAYED = "relayed"  # dialled at ports a relay leased it (``diloco.swarm.relay``), checked as a direct rank is
_LENGTH = struct.Struct("!H")


@dataclass(frozen=True)
class Reach:
    """What a rank learnt of itself: `kind` (``DIRECT``, ``OUTBOUND``, ``RELAYED`` or ``UNCHECKED``), in words how,
    and a relay that a peer offered (its libp2p peer id and control port; None: none offered)."""

    kind: str
    detail: str = ""
    relay: tuple[str, int] | None = None

    @property
    def dialable(self) -> bool:
        """Whether the others may plan to dial it (an unchecked rank is, as every rank was before the check)."""
        return self.kind != OUTBOUND


class Probes:
    """The listener's side: a service for ``MAGIC`` connections that notes the nonces they bring
    (``Listener.serve(MAGIC, probes)``), of those this rank awaits (``expect``) alone: what strangers send is
    answered and kept nowhere."""

    def __init__(self, timeout: float = DIAL_TIMEOUT_S):
        self._timeout = timeout
        self._awaited: dict[bytes, bool] = {}  # nonce -> a probe brought it
        self._cv = threading.Condition()

    def __call__(self, conn: socket.socket) -> None:
        nonce = bytearray(NONCE_SIZE)
        conn.settimeout(self._timeout)
        recv_exact(conn, memoryview(nonce), time.monotonic() + self._timeout)
        with self._cv:
            if bytes(nonce) in self._awaited:
                self._awaited[bytes(nonce)] = True
                self._cv.notify_all()
        conn.sendall(ACK)

    def expect(self, nonce: bytes) -> None:
        """Await `nonce` (before asking a peer to bring it: its probe may come before the answer does)."""
        with self._cv:
            self._awaited[nonce] = False

    def arrived(self, nonce: bytes, wait: float) -> bool:
        """Whether a probe brought `nonce` (waiting up to `wait` seconds for it); no longer awaits it."""
        deadline = time.monotonic() + wait
        with self._cv:
            while not self._awaited.get(nonce) and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(left)
            return bool(self._awaited.pop(nonce, False))


def peer_ids(maddrs: Sequence[str]) -> list[str]:
    """The libp2p peer ids in multiaddrs (``.../p2p/<id>``), in order, once each."""
    from multiaddr import Multiaddr

    found: list[str] = []
    for maddr in maddrs:
        with contextlib.suppress(Exception):  # (validated at the edge; a multiaddr without /p2p/ names no one)
            peer = Multiaddr(maddr).value_for_protocol("p2p")
            if peer and peer not in found:
                found.append(peer)
    return found


def hosts_of(maddrs: Sequence[str], peer: str) -> list[str]:
    """The IP addresses and DNS names at which `maddrs` (``.../p2p/<id>``) place the libp2p peer `peer`, in order."""
    from multiaddr import Multiaddr

    hosts: list[str] = []
    for maddr in maddrs:
        with contextlib.suppress(Exception):  # (validated at the edge)
            parsed = Multiaddr(maddr)
            if parsed.value_for_protocol("p2p") != peer:
                continue
            names = []
            for protocol in ("dns", "dns4", "dns6"):
                with contextlib.suppress(Exception):  # the multiaddr has no such part
                    names.append(parsed.value_for_protocol(protocol))
            for host in [*ips(parsed), *names]:
                if host and host not in hosts:
                    hosts.append(host)
    return hosts


def check(dht: Any, peers: Sequence[str], endpoint: tuple[Sequence[str], int], probes: Probes,
          timeout: float = ASK_TIMEOUT_S) -> Reach:  # fmt: skip
    """Ask `peers` (libp2p peer ids), one after another, to dial `endpoint` (``([hosts], port)``) back, until one
    answers; `probes` must serve this rank's listener. A rank found outbound only goes on asking the next peers
    until one offers a relay (``Reach.relay``). Never raises."""
    found: Reach | None = None
    for peer in peers:
        reach = _ask_one(dht, peer, endpoint, probes, timeout)
        if reach is None:
            continue
        found = found or reach
        if found.kind != OUTBOUND or reach.relay is not None:
            return Reach(found.kind, found.detail, reach.relay)
    return found or Reach(UNCHECKED, "no initial peer answered a dial-back request")


def _ask_one(dht: Any, peer: str, endpoint: tuple[Sequence[str], int], probes: Probes, timeout: float
             ) -> Reach | None:  # fmt: skip
    """`peer`'s verdict on `endpoint`, with its relay offer; None when it did not answer."""
    hosts, port = endpoint
    nonce = secrets.token_bytes(NONCE_SIZE)
    probes.expect(nonce)
    request = {"hosts": list(hosts)[:MAX_HOSTS], "port": int(port), "nonce": nonce.hex()}
    try:
        answer = dht.run_coroutine(partial(_ask, peer, _framed(request), timeout))
    except Exception as e:  # noqa: BLE001 - a DHT that is shutting down
        answer = {"error": f"{type(e).__name__}: {e}"}
    if not isinstance(answer, dict) or "error" in answer:  # no stream to it, a peer without the protocol, late
        log.debug("dial-back: %s did not answer: %s", peer, answer.get("error") if isinstance(answer, dict) else "")
        return None
    # what a peer answers goes into this rank's log: only our own hosts and an IP address are quoted
    reached = [h for h in hosts if isinstance(answer.get("reached"), list) and h in answer["reached"]]
    seen_at = answer.get("observed")
    relay = (peer, answer["relay"]) if type(answer.get("relay")) is int and 0 < answer["relay"] < 65536 else None
    if probes.arrived(nonce, ARRIVAL_WAIT_S):
        where = ", ".join(reached) or "its announced host"
        return Reach(DIRECT, f"peer {peer[-8:]} dialled it back at {where} port {port}", relay)
    seen = f"; that peer sees it at {seen_at}" if _is_ip(seen_at) else ""
    return Reach(OUTBOUND, f"peer {peer[-8:]} could not dial {' or '.join(hosts)} port {port}{seen}", relay)


def _is_ip(value: object) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in str(value) else socket.AF_INET, str(value))
    except OSError:
        return False
    return isinstance(value, str)


def serve(dht: Any, relay_port: int | None = None) -> None:
    """Answer dial-back requests on `dht`'s daemon from now on (in its DHT process), offering the relay whose
    control port is `relay_port` on this machine (``diloco.swarm.relay``) to ranks found outbound only. Raises what
    registering raises (a second registration on one daemon)."""
    dht.run_coroutine(partial(_register, relay_port))


# ---------------------------------------------------------------- in the DHT process


async def _register(relay_port: int | None, _dht: Any, node: Any) -> None:
    await node.p2p.add_binary_stream_handler(PROTOCOL, DialBack(relay_port).answer)


class DialBack:
    """A serving peer's handler: dials each host of a request at its port and sends the nonce there; tells of the
    relay it offers (`relay_port`), if any."""

    def __init__(self, relay_port: int | None = None) -> None:
        self._at_once = asyncio.Semaphore(AT_ONCE)
        self._relay_port = relay_port

    async def answer(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hosts, port, nonce = _request(await asyncio.wait_for(_read(reader), DIAL_TIMEOUT_S))
            async with self._at_once:
                reached = [host for host, ok in zip(hosts, await asyncio.gather(
                    *(_dial(host, port, nonce) for host in hosts))) if ok]  # fmt: skip
            observed = ips(info.addr) if getattr(info, "addr", None) is not None else []
            answer: dict[str, Any] = {"reached": reached, "observed": observed[0] if observed else ""}
            if self._relay_port is not None:
                answer["relay"] = self._relay_port
            writer.write(_framed(answer))
            await writer.drain()
        except Exception as e:  # noqa: BLE001 - a malformed request, a requester that left: this request only
            log.debug("dial-back request refused: %s: %s", type(e).__name__, e)
        finally:
            writer.close()


def _request(data: bytes) -> tuple[list[str], int, bytes]:
    """(hosts, port, nonce) of a request, checked; ValueError otherwise."""
    request = json.loads(data)
    hosts, port, nonce = request["hosts"], request["port"], bytes.fromhex(request["nonce"])
    if not isinstance(hosts, list) or not 0 < len(hosts) <= MAX_HOSTS or not all(isinstance(h, str) for h in hosts):
        raise ValueError("hosts")
    for host in hosts:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)  # IP addresses only, no names
    if type(port) is not int or not 1024 <= port < 65536 or len(nonce) != NONCE_SIZE:
        raise ValueError("port or nonce")
    return list(dict.fromkeys(hosts)), port, nonce


async def _dial(host: str, port: int, nonce: bytes) -> bool:
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_TIMEOUT_S)
        writer.write(MAGIC + nonce)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(len(ACK)), DIAL_TIMEOUT_S) == ACK
    except Exception:  # noqa: BLE001 - unreachable, refused, not a listener of ours: not reached
        return False
    finally:
        if writer is not None:
            writer.close()


async def _ask(peer: str, request: bytes, timeout: float, _dht: Any, node: Any) -> Any:
    """Runs in the asking rank's DHT process: one request to `peer`, its answer (a dict)."""
    from hivemind.p2p import PeerID

    async def exchange() -> Any:
        _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(peer), PROTOCOL)
        try:
            writer.write(request)
            await writer.drain()
            return json.loads(await _read(reader))
        finally:
            writer.close()

    try:
        return await asyncio.wait_for(exchange(), timeout)
    except Exception as e:  # noqa: BLE001 - returned, not raised: hivemind would log a traceback for each
        return {"error": f"{type(e).__name__}: {e}"}


def _framed(message: dict) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return _LENGTH.pack(len(data)) + data


async def _read(reader: asyncio.StreamReader) -> bytes:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_MESSAGE:
        raise ValueError(f"a message of {length} bytes")
    return await reader.readexactly(length)

"""What a relay and the ranks that lease its ports say to each other, over plain TCP to the relay's control port.

A rank that nobody can dial opens a *control* connection: ``LEASE``, then a request (``{"count": n, "want":
[ports]}``, length-prefixed JSON), and reads the answer (``{"ports": [...], "observed": ip}`` or ``{"error":
...}``). The leases last as long as that connection: while it is open, the relay sends a ``KEEPALIVE`` byte every
``KEEPALIVE_S`` and, for each connection that arrives at a leased port, an ``ARRIVED`` frame (a fresh 16-byte id,
the port's index in the answer, the caller's IP address). The rank fetches that connection by opening a *data*
connection, ``DATA`` and the id; from then on the relay copies bytes both ways between the two. The rank sends a
``KEEPALIVE`` byte every ``KEEPALIVE_S`` too, so home routers keep the control connection's mapping alive, and each
side takes ``DEAD_AFTER_S`` of silence for a dead peer.

Ids are random and go only to the lease's holder: nobody else can take a connection meant for it. The relay reads
nothing of the bytes it copies: a round's connections are signed end to end (``diloco.swarm.rounds.hello``), and
sealed in a keyed swarm, as over any other path.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

from diloco.swarm.rounds.frames import recv_exact

LEASE, DATA = b"DLRL", b"DLRD"  # a connection's first four bytes
KEEPALIVE, ARRIVED = b"K", b"C"
ID_SIZE = 16
KEEPALIVE_S = 10.0
DEAD_AFTER_S = 3 * KEEPALIVE_S
HELLO_TIMEOUT_S = 5.0  # for a connection's first bytes, and a lease's request and answer
MAX_MESSAGE = 4096
MAX_PORTS = 4  # leased by one control connection: a rank's listener and its DHT peer need two
_LENGTH = struct.Struct("!H")


def send_message(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_message(sock: socket.socket, deadline: float) -> dict:
    """One length-prefixed JSON object, read by `deadline` (monotonic); ValueError for anything else."""
    header = bytearray(_LENGTH.size)
    recv_exact(sock, memoryview(header), deadline)
    (length,) = _LENGTH.unpack(header)
    if length > MAX_MESSAGE:
        raise ValueError(f"a message of {length} bytes")
    data = bytearray(length)
    recv_exact(sock, memoryview(data), deadline)
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("a message that is not an object")
    return message


def arrived(conn_id: bytes, index: int, caller: str) -> bytes:
    """The ``ARRIVED`` frame for a connection from `caller` (an IP address) at leased port `index`."""
    address = caller.encode()[:255]
    return ARRIVED + conn_id + bytes([index, len(address)]) + address


def read_arrived(sock: socket.socket) -> tuple[bytes, int, str]:
    """The rest of an ``ARRIVED`` frame (its first byte read): (id, index, caller)."""
    deadline = time.monotonic() + HELLO_TIMEOUT_S
    head = bytearray(ID_SIZE + 2)
    recv_exact(sock, memoryview(head), deadline)
    address = bytearray(head[-1])
    recv_exact(sock, memoryview(address), deadline)
    return bytes(head[:ID_SIZE]), head[ID_SIZE], address.decode("ascii", "replace")


def keep_alive(sock: socket.socket, sending: threading.Lock) -> threading.Event:
    """Send a ``KEEPALIVE`` byte on `sock` every ``KEEPALIVE_S`` (under `sending`, which every writer of `sock`
    holds) from a thread of its own, until the returned event is set or a send fails."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(KEEPALIVE_S):
            try:
                with sending:
                    sock.sendall(KEEPALIVE)
            except OSError:
                return

    threading.Thread(target=beat, daemon=True, name="relay-keepalive").start()
    return stop

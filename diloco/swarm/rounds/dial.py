"""Dialling a rank: a TCP connection to one of the hosts it announced, past the handshake that tells it from any
other listener.

A rank announces every address its DHT sees (a LAN or public address first, loopback last). From another machine
loopback reaches the wrong process; from the same machine the LAN address may be filtered and time out. Trying the
hosts one after another would make a dead first host cost the whole timeout before the right one is tried, so they
are tried as RFC 8305 ("happy eyeballs") does: the next attempt starts once every earlier one failed or `STAGGER_S`
after the previous one started, whichever comes first, and the first connection that passes the handshake wins.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Sequence
from typing import Callable

Endpoint = tuple[Sequence[str], int]  # the hosts a rank's listener may be reached at, and its port
Handshake = Callable[[socket.socket], socket.socket]
# (endpoint, timeout, handshake or None) -> a connected socket past the handshake: ``connect`` over TCP, or
# ``diloco.swarm.rounds.tunnel.Tunnel.connect`` over libp2p
Connect = Callable[[Endpoint, float, "Handshake | None"], socket.socket]

STAGGER_S = 0.25  # RFC 8305's recommended connection attempt delay


class _Attempts:
    """The attempts of one `connect`: one thread per host, started in turn; their outcomes in `outcomes`."""

    def __init__(self, hosts: Sequence[str], port: int, deadline: float) -> None:
        self.hosts, self.port, self.deadline = list(hosts), port, deadline
        self.outcomes: queue.Queue[tuple[int, socket.socket | None, str]] = queue.Queue()
        self.cond = threading.Condition()
        self.failed = 0  # attempts over without a connection that passed (the next one need not wait any longer)
        self.done = False  # a connection won, or the caller gave up: later connections are closed at once

    def start(self) -> None:
        for i in range(len(self.hosts)):
            threading.Thread(target=self._attempt, args=(i,), name=f"dial-{self.hosts[i]}", daemon=True).start()

    def _attempt(self, i: int) -> None:
        with self.cond:  # wait for the earlier attempts to fail, or for this one's turn
            self.cond.wait_for(lambda: self.done or self.failed >= i, timeout=i * STAGGER_S)
            if self.done:
                return
        try:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock = socket.create_connection((self.hosts[i], self.port), timeout=left)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, ValueError, OverflowError) as e:  # (a host name no resolver takes, a port out of range)
            self.outcomes.put((i, None, str(e)))
            self.fail()
            return
        with self.cond:
            if self.done:  # another host won meanwhile
                sock.close()
                return
            self.outcomes.put((i, sock, ""))

    def fail(self) -> None:
        with self.cond:
            self.failed += 1
            self.cond.notify_all()

    def finish(self) -> None:
        """No connection is wanted any more: close those that arrived unused, and any that arrive later."""
        with self.cond:
            self.done = True
            self.cond.notify_all()
        while True:
            try:
                _, sock, _ = self.outcomes.get_nowait()
            except queue.Empty:
                return
            if sock is not None:
                sock.close()


def connect(endpoint: Endpoint, timeout: float, handshake: Handshake | None = None) -> socket.socket:
    """A TCP connection to `endpoint` past `handshake` (which closes the socket if it fails), its hosts tried as the
    module says; every attempt ends within `timeout`. ConnectionError naming each host's error when none works."""
    hosts, port = endpoint
    if not hosts:
        raise ConnectionError("could not connect: no address")
    attempts = _Attempts(hosts, port, time.monotonic() + timeout)
    errors: dict[int, str] = {}
    attempts.start()
    try:
        while len(errors) < len(hosts):
            i, sock, error = attempts.outcomes.get()
            if sock is None:
                errors[i] = error
                continue
            try:
                return handshake(sock) if handshake is not None else sock
            except (OSError, ValueError) as e:  # the wrong peer, or the right one failing: the next host may do
                errors[i] = str(e)
                attempts.fail()
    finally:
        attempts.finish()
    raise ConnectionError("could not connect: " + "; ".join(f"{hosts[i]}:{port}: {errors[i]}" for i in sorted(errors)))

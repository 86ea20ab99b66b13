"""A rank's listening TCP socket, shared by the protocols that reach it: each incoming connection goes to the round
of ``diloco.swarm.rounds.tcp`` that its hello names, or to a service registered for its first four bytes (the state
downloads of ``diloco.swarm.rounds.transfer``). Connections that arrive otherwise (the libp2p streams of
``diloco.swarm.rounds.tunnel``) are handed in as sockets and dispatched alike."""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

from diloco.errors import FieldError
from diloco.swarm.rounds.frames import recv_exact
from diloco.swarm.rounds.tcp import HELLO, MAC_SIZE, MAGIC, Round, close_socket

logger = logging.getLogger(__name__)

ENDED_KEPT = 256  # rounds a listener remembers having left (a few per outer step, fragments and retries included)


class Listener:
    """The averager process's listening socket: hands each incoming connection to the ``Round`` it names.

    :param sock: a bound, listening TCP socket (``listen_socket``); owned from now on. None: connections only come
        through ``handle``.
    :param handshake_timeout: seconds a connection may take to send its hello.
    :param registration_timeout: seconds a connection waits for its round to be registered here: a groupmate
        may learn of the group and start the round seconds before this peer does (None: ``handshake_timeout``).
    :param idle_wait: seconds it waits instead while this rank is in no round (``in_round``): a group that
        averaged alone after a matchmaking split never registers the round its would-be groupmates started, and
        they should learn that soon, not after ``registration_timeout`` (None: no difference).
    """

    def __init__(self, sock: socket.socket | None, handshake_timeout: float, registration_timeout: float | None = None,
                 idle_wait: float | None = None):  # fmt: skip
        self._sock, self._timeout = sock, handshake_timeout
        self._registration_timeout = handshake_timeout if registration_timeout is None else registration_timeout
        registration = self._registration_timeout
        self._idle_wait = registration if idle_wait is None else min(idle_wait, registration)
        self._busy = 0  # rounds this rank is in (``in_round``)
        self._rounds: dict[bytes, Round] = {}
        self._services: dict[bytes, Callable[[socket.socket], None]] = {}
        self._cv = threading.Condition()
        self._closed = False
        self.refused = 0  # connections dropped at their hello: strangers, bad MACs, replays, late senders
        # tags of the last rounds this rank left: a hello for one of them (a late groupmate, a replay) is dropped at
        # once instead of holding a thread for the registration timeout
        self._ended: collections.deque[bytes] = collections.deque(maxlen=ENDED_KEPT)
        self._warned = False

    def start(self) -> Listener:
        if self._sock is not None:
            threading.Thread(target=self._accept, daemon=True, name="butterfly-accept").start()
        return self

    def handle(self, conn: socket.socket) -> None:
        """Dispatch a connection that did not come through the listening socket (owned from now on)."""
        threading.Thread(target=self._handshake, args=(conn,), daemon=True, name="butterfly-hello").start()

    def serve(self, magic: bytes, handler: Callable[[socket.socket], None]) -> None:
        """Hand connections that open with the 4 bytes `magic` to `handler` (on their own thread; closed after)."""
        self._services[magic] = handler

    @contextlib.contextmanager
    def in_round(self) -> Iterator[None]:
        """While this rank takes part in a round (matchmaking included), connections for a round not registered yet
        wait the full ``registration_timeout``."""
        with self._cv:
            self._busy += 1
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                self._busy -= 1

    def register(self, round_: Round) -> None:
        with self._cv:
            self._rounds[round_.tag] = round_
            self._cv.notify_all()

    def unregister(self, round_: Round) -> None:
        with self._cv:
            self._rounds.pop(round_.tag, None)
            self._ended.append(round_.tag)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._sock is not None:
            close_socket(self._sock)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self.handle(conn)

    def _handshake(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self._timeout)
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = bytearray(HELLO.size + MAC_SIZE)
            recv_exact(conn, memoryview(hello)[: len(MAGIC)])
            if (service := self._services.get(bytes(hello[: len(MAGIC)]))) is not None:
                try:
                    return service(conn)
                finally:
                    close_socket(conn)
            recv_exact(conn, memoryview(hello)[len(MAGIC) :])
            magic, tag = HELLO.unpack_from(hello)[:2]
            if magic != MAGIC:
                raise ConnectionError("not a butterfly connection")
            with self._cv:
                started = time.monotonic()
                while tag not in self._rounds and tag not in self._ended and not self._closed:
                    wait = self._registration_timeout if self._busy else self._idle_wait
                    left = started + wait - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)  # woken by a registration, by close, or by this rank entering a round
                round_ = self._rounds.get(tag)
            if round_ is None:
                raise _NoRound("a round that ended here" if tag in self._ended else "no round with this tag")
            round_.attach(conn, bytes(hello))
        except Exception as e:  # a stranger, a late or duplicate sender: drop the connection, never the process
            with self._cv:
                self.refused += 1
                warn = not self._warned and not isinstance(e, _NoRound)
                self._warned |= warn
            if warn:  # a round that ended (a late groupmate, a replayed hello) is routine; the rest is not
                logger.warning(f"refused a connection: {type(e).__name__}: {e} (later ones are only counted)")
            else:
                logger.debug(f"butterfly connection dropped: {type(e).__name__}: {e}")
            close_socket(conn)


class _NoRound(ConnectionError):
    """A hello for a round this rank does not hold (any more): late, or replayed."""


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (port 0: any free port), for ``Listener``."""
    return socket.create_server((host, port), backlog=128)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` for the transport; `FieldError` naming the flag when it cannot."""
    try:
        return listen_socket(host, port)
    except OSError as e:
        why = e.strerror or str(e)
        field = "averaging_port" if port else "host_maddrs"  # port 0 fails only for a host not on this machine
        message = f"{{{field}}}: cannot listen on {host} port {port}: {why[:1].lower()}{why[1:]}"
        raise FieldError(message, per_rank=True) from None

"""A rank's listening TCP socket, shared by the protocols that reach it: each incoming connection goes to the round
of ``diloco.swarm.rounds.tcp`` that its hello names, or to a service registered for its first four bytes (the state
downloads of ``diloco.swarm.rounds.transfer``). Connections that arrive otherwise (the libp2p streams of
``diloco.swarm.rounds.tunnel``) are handed in as sockets and dispatched alike.

Anyone who reaches the port may connect, so what a connection costs is bounded: each one holds a thread until its
hello is read (by an absolute deadline, however slowly its bytes come) and its round or service is done with it,
and connections past a cap in total or per remote host are closed at once, counted in ``refused``."""

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
MAX_CONNECTIONS = 256  # connections handled at once (each holds a thread): far more than a group's rounds need
MAX_PER_HOST = 32  # of which from one remote address: one flooding host cannot take every slot
ACCEPT_PAUSE_S = 0.05  # after a failed accept (out of file descriptors) before the next
TUNNEL = "tunnel"  # the host key of connections handed in without an address (libp2p streams)


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
    :param max_connections: connections handled at once (from the hello to the end of a service, or to a round taking
        the connection over); more are closed at once and counted in ``refused``. Raise it for a rank that serves
        many groups at once; a warning "refused a connection: ... connections at once" says it was reached.
    :param max_per_host: of which from one remote address (connections handed in through ``handle`` without one
        count under one key).
    """

    def __init__(self, sock: socket.socket | None, handshake_timeout: float, registration_timeout: float | None = None,
                 idle_wait: float | None = None, max_connections: int = MAX_CONNECTIONS,
                 max_per_host: int = MAX_PER_HOST):  # fmt: skip
        if max_connections < 1 or max_per_host < 1:
            raise ValueError(f"connection caps must be at least 1 (got {max_connections}, {max_per_host})")
        self._sock, self._timeout = sock, handshake_timeout
        self._max_connections, self._max_per_host = max_connections, max_per_host
        self._open: collections.Counter[str] = collections.Counter()  # connections being handled, per host key
        self._registration_timeout = handshake_timeout if registration_timeout is None else registration_timeout
        registration = self._registration_timeout
        self._idle_wait = registration if idle_wait is None else min(idle_wait, registration)
        self._busy = 0  # rounds this rank is in (``in_round``)
        self._rounds: dict[bytes, Round] = {}
        self._services: dict[bytes, Callable[[socket.socket], None]] = {}
        self._cv = threading.Condition()
        self._closed = False
        self.refused = 0  # connections dropped: at their hello (strangers, bad MACs, replays, late) or over a cap
        # tags of the last rounds this rank left: a hello for one of them (a late groupmate, a replay) is dropped at
        # once instead of holding a thread for the registration timeout
        self._ended: collections.deque[bytes] = collections.deque(maxlen=ENDED_KEPT)
        self._warned = False

    def start(self) -> Listener:
        if self._sock is not None:
            threading.Thread(target=self._accept, daemon=True, name="butterfly-accept").start()
        return self

    def handle(self, conn: socket.socket, host: str = TUNNEL) -> None:
        """Dispatch a connection that did not come through the listening socket (owned from now on), counted under
        `host` for ``max_per_host``. Never raises: a connection over a cap, or whose thread cannot start, is closed."""
        with self._cv:
            over = self._over_cap(host)
            if over is None:
                self._open[host] += 1
        if over is not None:
            return self._refuse(conn, ConnectionRefusedError(over))
        try:
            threading.Thread(target=self._handled, args=(conn, host), daemon=True, name="butterfly-hello").start()
        except Exception as e:  # threads exhausted (RuntimeError), out of memory: this connection only
            self._release(host)
            self._refuse(conn, e)

    @property
    def open_connections(self) -> int:
        """Connections being handled now (for ``max_connections``)."""
        with self._cv:
            return sum(self._open.values())

    def _over_cap(self, host: str) -> str | None:
        """Why a connection from `host` may not be handled now, or None (under ``_cv``)."""
        if sum(self._open.values()) >= self._max_connections:
            return f"{self._max_connections} connections at once (max_connections)"
        if self._open[host] >= self._max_per_host:
            return f"{self._max_per_host} connections at once from {host} (max_per_host)"
        return None

    def _release(self, host: str) -> None:
        with self._cv:
            self._open[host] -= 1
            if self._open[host] <= 0:
                del self._open[host]

    def _handled(self, conn: socket.socket, host: str) -> None:
        try:
            self._handshake(conn)
        finally:
            self._release(host)

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
                conn, address = self._sock.accept()
            except OSError as e:
                if self._closed:
                    return
                # out of file descriptors, a connection reset before it was accepted: this one only
                logger.debug(f"accept failed: {type(e).__name__}: {e}")
                time.sleep(ACCEPT_PAUSE_S)  # (EMFILE repeats until a connection ends: no busy loop)
                continue
            try:
                self.handle(conn, str(address[0]) if isinstance(address, tuple) and address else TUNNEL)
            except Exception as e:  # never the accept loop: it is the rank's only way in
                logger.debug(f"a connection could not be handled: {type(e).__name__}: {e}")
                close_socket(conn)

    def _handshake(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self._timeout)
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # the whole hello by one deadline: a peer sending a byte every few seconds cannot hold the thread longer
            deadline = time.monotonic() + self._timeout
            hello = bytearray(HELLO.size + MAC_SIZE)
            recv_exact(conn, memoryview(hello)[: len(MAGIC)], deadline)
            if (service := self._services.get(bytes(hello[: len(MAGIC)]))) is not None:
                try:
                    return service(conn)
                finally:
                    close_socket(conn)
            recv_exact(conn, memoryview(hello)[len(MAGIC) :], deadline)
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
            self._refuse(conn, e)

    def _refuse(self, conn: socket.socket, e: BaseException) -> None:
        """Close `conn` and count it; warn of the first refusal that is not routine."""
        with self._cv:
            self.refused += 1
            warn = not self._warned and not isinstance(e, _NoRound)
            self._warned |= warn
        if warn:  # a round that ended (a late groupmate, a replayed hello) is routine; the rest is not
            logger.warning(f"refused a connection: {type(e).__name__}: {e} (later ones are only counted)")
        else:
            logger.debug(f"butterfly connection dropped: {type(e).__name__}: {e}")
        close_socket(conn)


def close_with_tunnel(listener: Listener, tunnel: object | None) -> None:
    """Stop taking connections: the tunnel's streams first (``tunnel.Tunnel``, which feeds `listener`; None over
    TCP), then the listener."""
    try:
        if tunnel is not None:
            tunnel.close()  # type: ignore[attr-defined]
    finally:
        listener.close()


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

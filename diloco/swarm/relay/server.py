"""The relay's side: ``diloco dht --relay-ports FIRST-LAST`` listens on FIRST (the control port) and leases the
other ports to ranks that nobody can dial, as a TURN server allocates relayed addresses. A leased port is bound
while its control connection lasts; each connection that arrives there waits (at most ``PENDING_S``) until the
rank fetches it, then the relay copies its bytes both ways (``splice``). The protocol: ``protocol``.

Anyone who reaches the control port may ask, so what it costs is bounded: a few ports per control connection, a
few control connections per IP address, connections waiting per port and pairs copied at once, all capped; a
request, or a data connection's id, must come within a few seconds."""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence

from diloco.swarm.relay import protocol
from diloco.swarm.relay.splice import splice
from diloco.swarm.rounds.frames import recv_exact

log = logging.getLogger("diloco")

PENDING_S = 10.0  # a connection at a leased port waits this long for its rank to fetch it
MAX_PENDING = 64  # waiting connections per leased port
MAX_CONTROLS_PER_HOST = 16  # control connections from one IP address (a machine of 8 ranks needs 8)
MAX_PAIRS = 512  # connections copied at once (each holds two threads)
MAX_OPENING = 256  # connections at the control port not past their first bytes yet (each holds a thread)


class Relay:
    """Leases `ports` (bound on `host` when leased) to the ranks that ask at `host`:`control_port`; a connection's
    first bytes, and a lease's request, must come within `hello_timeout` seconds. ``close()`` ends every lease and
    connection. Raises OSError when the control port cannot be bound."""

    def __init__(self, host: str, control_port: int, ports: Sequence[int],
                 hello_timeout: float = protocol.HELLO_TIMEOUT_S):  # fmt: skip
        self._host, self._hello_timeout = host, hello_timeout
        self._control = socket.create_server((host, control_port), backlog=128)
        self.control_port = self._control.getsockname()[1]
        self._free = list(dict.fromkeys(p for p in ports if p != self.control_port))
        self._lock = threading.Lock()
        # id -> (a connection that arrived at a leased port, its deadline, the control connection of its lease)
        self._pending: dict[bytes, tuple[socket.socket, float, socket.socket]] = {}
        self._controls: collections.Counter[str] = collections.Counter()  # open control connections per IP
        self._pairs = 0
        self._opening = 0
        self._closed = False
        self._sockets: set[socket.socket] = set()  # leased ports' listening sockets and control connections

    @property
    def free_ports(self) -> int:
        """Ports not leased now."""
        with self._lock:
            return len(self._free)

    def start(self) -> Relay:
        threading.Thread(target=self._accept, args=(self._control, self._first_bytes), daemon=True,
                         name="relay-control").start()  # fmt: skip
        threading.Thread(target=self._expire, daemon=True, name="relay-expire").start()
        return self

    def close(self) -> None:
        with self._lock:
            self._closed = True
            doomed = [self._control, *self._sockets, *(conn for conn, _, _ in self._pending.values())]
            self._pending.clear()
        for sock in doomed:
            _close(sock)

    # ------------------------------------------------------------ connections at the control port

    def _accept(self, server: socket.socket, handler: Callable[[socket.socket, str], None]) -> None:
        while True:
            try:
                conn, address = server.accept()
            except OSError:
                if self._closed or server.fileno() < 0:
                    return
                time.sleep(0.05)  # out of file descriptors: this one only
                continue
            host = str(address[0])
            try:
                threading.Thread(target=handler, args=(conn, host), daemon=True, name="relay-conn").start()
            except RuntimeError:  # threads exhausted: this connection only
                _close(conn)

    def _first_bytes(self, conn: socket.socket, host: str) -> None:
        with self._lock:
            full = self._opening >= MAX_OPENING
            self._opening += not full
        if full:  # a flood of idle connections: the newest are closed, each hello's wait bounds the others
            _close(conn)
            return
        released = threading.Event()

        def opened() -> None:  # past its first bytes (a lease then lasts as long as its rank keeps it)
            with self._lock:
                if not released.is_set():
                    released.set()
                    self._opening -= 1

        try:
            self._opened(conn, host, opened)
        finally:
            opened()

    def _opened(self, conn: socket.socket, host: str, opened: Callable[[], None]) -> None:
        try:
            conn.settimeout(self._hello_timeout)
            magic = bytearray(len(protocol.LEASE))
            recv_exact(conn, memoryview(magic), time.monotonic() + self._hello_timeout)
            if bytes(magic) == protocol.LEASE:
                return self._lease(conn, host, opened)
            if bytes(magic) == protocol.DATA:
                return self._fetch(conn)
            raise ValueError("not a relay connection")
        except Exception as e:  # noqa: BLE001 - a stranger, a rank that left: this connection only
            log.debug("relay: a connection from %s dropped: %s: %s", host, type(e).__name__, e)
            _close(conn)

    def _fetch(self, conn: socket.socket) -> None:
        conn_id = bytearray(protocol.ID_SIZE)
        recv_exact(conn, memoryview(conn_id), time.monotonic() + self._hello_timeout)
        with self._lock:
            waiting = self._pending.pop(bytes(conn_id), None)
            if waiting is not None and self._pairs >= MAX_PAIRS:
                _close(waiting[0])
                raise ConnectionError(f"{MAX_PAIRS} connections relayed at once")
            self._pairs += waiting is not None
        if waiting is None:
            raise ConnectionError("no connection waits under this id")
        splice(waiting[0], conn, name="relay-copy", done=self._pair_ended)

    def _pair_ended(self) -> None:
        with self._lock:
            self._pairs -= 1

    def _lease(self, conn: socket.socket, host: str, opened: Callable[[], None]) -> None:
        with self._lock:
            if self._controls[host] >= MAX_CONTROLS_PER_HOST:
                raise ConnectionError(f"{MAX_CONTROLS_PER_HOST} leases from {host} at once")
            self._controls[host] += 1
            self._sockets.add(conn)
        servers: list[socket.socket] = []
        try:
            request = protocol.recv_message(conn, time.monotonic() + self._hello_timeout)
            count, want = request.get("count"), request.get("want", [])
            if type(count) is not int or not 0 < count <= protocol.MAX_PORTS or not isinstance(want, list):
                raise ValueError("a malformed lease request")
            servers = self._bind(count, [p for p in want if type(p) is int])
            if len(servers) < count:
                protocol.send_message(conn, {"error": f"{count} port(s) asked, {len(servers)} free"})
                return
            protocol.send_message(conn, {"ports": [s.getsockname()[1] for s in servers], "observed": host})
            opened()
            log.info("relay: leased port(s) %s to %s", ", ".join(str(s.getsockname()[1]) for s in servers), host)
            self._serve_lease(conn, servers)
        finally:
            self._release(servers)
            with self._lock:
                self._controls[host] -= 1
                if self._controls[host] <= 0:
                    del self._controls[host]
                self._sockets.discard(conn)
                orphans = [k for k, (_, _, owner) in self._pending.items() if owner is conn]
                doomed = [self._pending.pop(k)[0] for k in orphans]
            for sock in (conn, *doomed):
                _close(sock)

    def _bind(self, count: int, want: list[int]) -> list[socket.socket]:
        """Up to `count` listening sockets on free ports, those in `want` first (a rank back after a relay restart
        keeps the ports it announced)."""
        servers: list[socket.socket] = []
        with self._lock:
            order = [p for p in want if p in self._free] + [p for p in self._free if p not in want]
            for port in order:
                if len(servers) == count:
                    break
                try:
                    server = socket.create_server((self._host, port), backlog=128)
                except OSError:  # taken by another program meanwhile: the next one
                    continue
                self._free.remove(port)
                self._sockets.add(server)
                servers.append(server)
        return servers

    def _release(self, servers: list[socket.socket]) -> None:
        with self._lock:
            for server in servers:
                self._free.append(server.getsockname()[1])
                self._sockets.discard(server)
        for server in servers:
            _close(server)

    def _serve_lease(self, conn: socket.socket, servers: list[socket.socket]) -> None:
        """While the rank keeps the control connection: tell it of each arrived connection, keep the connection
        alive both ways. Returns when the rank leaves or falls silent."""
        sending = threading.Lock()
        for index, server in enumerate(servers):
            handler = self._arrival(conn, sending, index)
            threading.Thread(target=self._accept, args=(server, handler), daemon=True, name="relay-port").start()
        stop = protocol.keep_alive(conn, sending)
        try:
            conn.settimeout(protocol.DEAD_AFTER_S)
            while conn.recv(64):  # the rank's keepalives; end of file, silence or a reset end the lease
                pass
        except OSError:
            pass
        finally:
            stop.set()

    def _arrival(self, control: socket.socket, sending: threading.Lock, index: int
                 ) -> Callable[[socket.socket, str], None]:  # fmt: skip
        def arrived(conn: socket.socket, caller: str) -> None:
            conn_id = secrets.token_bytes(protocol.ID_SIZE)
            with self._lock:
                waiting = sum(1 for _, _, owner in self._pending.values() if owner is control)
                if self._closed or waiting >= MAX_PENDING:
                    _close(conn)
                    return
                self._pending[conn_id] = (conn, time.monotonic() + PENDING_S, control)
            try:
                with sending:
                    control.sendall(protocol.arrived(conn_id, index, caller))
            except OSError:  # the rank left: the lease ends, and this connection with it
                with self._lock:
                    self._pending.pop(conn_id, None)
                _close(conn)

        return arrived

    def _expire(self) -> None:
        while not self._closed:
            time.sleep(1.0)
            now = time.monotonic()
            with self._lock:
                late = [k for k, (_, deadline, _) in self._pending.items() if deadline < now]
                doomed = [self._pending.pop(k)[0] for k in late]
            for conn in doomed:
                _close(conn)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()

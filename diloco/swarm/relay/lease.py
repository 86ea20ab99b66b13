"""The rank's side of a relay (``server``): ports of the relay, leased while a control connection lasts, and every
connection that arrives at them fetched over a connection this rank opens, so a rank behind a home router (which
lets nothing in) is reached at the relay's address. A rank's listener takes those connections as if accepted
(``Listener.handle``); its DHT peer's daemon gets them through a local connection (``forward_to``).

A relay that goes away (restarted, its machine down) ends the leases: the rank says so once, and asks again every
``RETRY_S`` for the same ports, which a restarted relay grants, so the addresses it announced hold again."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

from diloco.swarm.relay import protocol
from diloco.swarm.relay.splice import splice
from diloco.swarm.rounds.dial import Endpoint, connect

log = logging.getLogger("diloco")

RETRY_S = 5.0
Target = Callable[[socket.socket, str], None]  # (a fetched connection, owned from now on; the caller's IP)


class Lease:
    """``len(targets)`` ports of the relay at `relay` (``([hosts], control port)``): a connection that arrives at
    ``ports[i]`` is handed to ``targets[i]``. ``host`` is the relay's address that answered (where others reach
    the ports), ``observed`` where the relay sees this rank from.

    :raises ConnectionError: the relay cannot be reached, or has not that many ports free (its words).
    """

    def __init__(self, relay: Endpoint, targets: Sequence[Target], want: Sequence[int] = ()):
        self._relay, self._targets = relay, list(targets)
        self._lock = threading.Lock()
        self._closed = False
        control, answer = self._ask(list(want))
        self.ports: list[int] = answer["ports"]
        self.host: str = control.getpeername()[0]
        self.observed = str(answer.get("observed", ""))[:64]
        self._control: socket.socket | None = control
        self.alive = True  # the leases hold now (False from a lost relay until it grants them again)
        threading.Thread(target=self._run, daemon=True, name="relay-lease").start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            control, self._control = self._control, None
        if control is not None:
            _close(control)

    def _ask(self, want: list[int]) -> tuple[socket.socket, dict]:
        control = connect(self._relay, protocol.HELLO_TIMEOUT_S)
        try:
            control.sendall(protocol.LEASE)
            protocol.send_message(control, {"count": len(self._targets), "want": want})
            answer = protocol.recv_message(control, time.monotonic() + protocol.HELLO_TIMEOUT_S)
            ports = answer.get("ports")
            if not isinstance(ports, list) or len(ports) != len(self._targets) or not all(
                    type(p) is int and 0 < p < 65536 for p in ports):  # fmt: skip
                raise ConnectionError(f"the relay leased no port: {str(answer.get('error', answer))[:200]}")
        except (OSError, ValueError) as e:
            _close(control)
            raise ConnectionError(f"{type(e).__name__}: {e}") from None
        return control, answer

    def _run(self) -> None:
        while True:
            with self._lock:
                control = self._control
            if control is not None:
                self._serve(control)
            with self._lock:
                if self._closed:
                    return
                self._control, self.alive = None, False
            if control is not None:
                _close(control)
            log.warning("the relay at %s port %d is gone: rounds that dial this rank fail until it returns (asking "
                        "again every %.0f s)", self.host, self._relay[1], RETRY_S)  # fmt: skip
            self._reconnect()

    def _reconnect(self) -> None:
        while True:
            time.sleep(RETRY_S)
            with self._lock:
                if self._closed:
                    return
            try:
                control, answer = self._ask(self.ports)
            except ConnectionError as e:
                log.debug("relay: not back yet: %s", e)
                continue
            if answer["ports"] != self.ports:  # this rank announced its old ports: others would dial those
                _close(control)
                log.debug("relay: back, but with ports %s instead of %s", answer["ports"], self.ports)
                continue
            with self._lock:
                if self._closed:
                    _close(control)
                    return
                self._control, self.alive = control, True
            log.warning("the relay at %s port %d is back: this rank can be dialled again", self.host,
                        self._relay[1])  # fmt: skip
            return

    def _serve(self, control: socket.socket) -> None:
        """Fetch what arrives until the relay leaves or falls silent."""
        stop = protocol.keep_alive(control, threading.Lock())  # (this side's only writer of the connection)
        try:
            control.settimeout(protocol.DEAD_AFTER_S)
            while (kind := control.recv(1)) in (protocol.KEEPALIVE, protocol.ARRIVED):
                if kind == protocol.ARRIVED:
                    conn_id, index, caller = protocol.read_arrived(control)
                    if index < len(self._targets):
                        threading.Thread(target=self._fetch, args=(conn_id, index, caller), daemon=True,
                                         name="relay-fetch").start()  # fmt: skip
        except (OSError, ValueError) as e:  # silence, a reset, a malformed frame: the relay is gone for us
            log.debug("relay: control connection ended: %s: %s", type(e).__name__, e)
        finally:
            stop.set()

    def _fetch(self, conn_id: bytes, index: int, caller: str) -> None:
        try:
            conn = socket.create_connection((self.host, self._relay[1]), timeout=protocol.HELLO_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(protocol.DATA + conn_id)
        except OSError as e:
            log.debug("relay: could not fetch a connection: %s", e)
            return
        self._targets[index](conn, caller)


def forward_to(port: int) -> Target:
    """A target that joins each fetched connection to a new one to this machine's `port` (a daemon that listens
    there, such as the DHT peer's p2pd)."""

    def forward(conn: socket.socket, _caller: str) -> None:
        try:
            local = socket.create_connection(("127.0.0.1", port), timeout=protocol.HELLO_TIMEOUT_S)
        except OSError as e:
            log.debug("relay: nothing listens at local port %d: %s", port, e)
            _close(conn)
            return
        splice(conn, local, name="relay-forward")

    return forward


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()

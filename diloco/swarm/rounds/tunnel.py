"""A rank's listener reached over libp2p: with ``--hv.transport p2pd`` the rounds of whole groups (``tcp``) and their
state downloads (``transfer``) travel as libp2p streams through the rank's p2pd daemon, which brings what p2pd is
chosen for (NAT traversal, relays, encryption) to groups of any shape.

Each stream is bridged to one end of a local socket pair, so those protocols' blocking-socket code runs unchanged:
the socket of an incoming stream goes to the rank's ``Listener`` as if it had been accepted there, and ``connect``
returns the socket of an outgoing one. Over p2pd a rank's endpoint is its libp2p peer id: ``((peer id,), 0)``.

The bridges run on one thread's asyncio loop with a replica of the DHT's libp2p peer (the same daemon, so the same
peer id). hivemind is pinned to 1.1.12; this relies on ``DHT.run_coroutine``, ``DHTNode.p2p``, and ``P2P``'s
``replicate``, ``daemon_listen_maddr``, ``add_binary_stream_handler``, ``remove_binary_stream_handler``,
``call_binary_stream_handler``, ``peer_id`` and ``shutdown``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from diloco.swarm.rounds.listener import Listener
from diloco.swarm.rounds.tcp import Endpoint, close_socket

log = logging.getLogger("diloco")

PROTOCOL = "/diloco/rank/1"  # the libp2p protocol name of a rank's listener
CHUNK = 2**16  # bytes copied per read, either way
START_TIMEOUT_S = 30.0


class Tunnel:
    """Bridges libp2p streams to and from this rank's ``listener``; ``close()`` ends every bridge.

    :param dht: this rank's running ``hivemind.DHT`` (its daemon carries the streams).
    :param listener: gets the socket of every incoming stream (``Listener.handle``).
    :raises ConnectionError: the daemon did not take the stream handler within ``START_TIMEOUT_S``; another error:
        it refused it (another open tunnel on the same daemon).
    """

    def __init__(self, dht: Any, listener: Listener):
        self.listener = listener
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="tunnel")
        self._thread.start()
        self._bridges: set[asyncio.Task] = set()
        self._p2p: Any = None
        self._registered = False  # the daemon hands this tunnel the streams of PROTOCOL (one tunnel per daemon)
        try:
            self.peer_id: str = self._call(self._start(dht), START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def connect(self, endpoint: Endpoint, timeout: float,
                handshake: Callable[[socket.socket], socket.socket] | None = None) -> socket.socket:  # fmt: skip
        """A blocking socket whose bytes travel on a new libp2p stream to the rank whose endpoint is
        ``((peer id,), 0)``, past ``handshake`` when given (it closes the socket if it fails)."""
        hosts, _ = endpoint
        if len(hosts) != 1:
            raise ConnectionError(f"the endpoint {endpoint} names no one libp2p peer")
        sock = self._call(self._open(str(hosts[0]), timeout), timeout + 1.0)
        sock.settimeout(timeout)
        return handshake(sock) if handshake is not None else sock

    def close(self) -> None:
        """Stop taking streams, end every bridge, and release the daemon connection; idempotent."""
        if self._loop.is_closed():
            return
        if self._loop.is_running():
            with contextlib.suppress(Exception):
                self._call(self._stop(), 5.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5.0)
        if not self._loop.is_running():
            self._loop.close()

    # -------------------------------------------------------------------------------- on the tunnel's loop

    async def _start(self, dht: Any) -> str:
        from hivemind.p2p import P2P

        # a replica of our own (``DHT.replicate_p2p`` caches one per process, and another tunnel would close it)
        self._p2p = await P2P.replicate(dht.run_coroutine(_daemon_listen_maddr))
        await self._p2p.add_binary_stream_handler(PROTOCOL, self._accept)
        self._registered = True
        return self._p2p.peer_id.to_base58()

    async def _stop(self) -> None:
        for task in list(self._bridges):
            task.cancel()
        await asyncio.gather(*self._bridges, return_exceptions=True)
        if self._registered:
            with contextlib.suppress(Exception):  # the daemon keeps a handler until told (another tunnel may come)
                await self._p2p.remove_binary_stream_handler(PROTOCOL)
        if self._p2p is not None:
            await self._p2p.shutdown()  # a replica: closes its client, leaves the DHT's daemon running

    async def _accept(self, _info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """An incoming stream: its local socket goes to the listener, which reads the hello as for TCP."""
        ours, theirs = socket.socketpair()
        self.listener.handle(theirs)
        await self._bridge(reader, writer, ours)

    async def _open(self, peer: str, timeout: float) -> socket.socket:
        from hivemind.p2p import PeerID

        try:
            _, reader, writer = await asyncio.wait_for(
                self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), PROTOCOL), timeout
            )
        except Exception as e:  # the daemon's errors (no route, protocol not supported), a bad id, a timeout
            raise ConnectionError(f"no libp2p stream to {peer}: {type(e).__name__}: {e}") from None
        ours, theirs = socket.socketpair()
        asyncio.ensure_future(self._bridge(reader, writer, ours))  # it registers itself in ``_bridges``
        return theirs

    async def _bridge(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ours: socket.socket) -> None:
        """Copy bytes both ways between a stream and our end of a socket pair. The local side ends the bridge: once
        it closed its end, the stream is flushed and closed. The remote side closing only ends what comes in (the
        local side then reads end-of-file, and closes)."""
        loop = asyncio.get_running_loop()
        ours.setblocking(False)

        async def inbound() -> None:
            try:
                while data := await reader.read(CHUNK):
                    await loop.sock_sendall(ours, data)
            except OSError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    ours.shutdown(socket.SHUT_WR)

        task = asyncio.current_task()
        if task is not None:
            self._bridges.add(task)
            task.add_done_callback(self._bridges.discard)
        incoming = asyncio.ensure_future(inbound())
        try:
            while data := await loop.sock_recv(ours, CHUNK):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            incoming.cancel()
            close_socket(ours)
            writer.close()  # after what is buffered was written
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _call(self, coroutine: Coroutine, timeout: float) -> Any:
        """Run `coroutine` on the tunnel's loop; ConnectionError when it takes longer than `timeout`."""
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        except RuntimeError:  # the loop is closed: the tunnel was
            coroutine.close()
            raise ConnectionError("the tunnel is closed") from None
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ConnectionError(f"no answer from the p2pd daemon within {timeout:.3g} s") from None


async def _daemon_listen_maddr(_dht: Any, node: Any) -> Any:
    """Runs in the DHT process: where its p2pd daemon takes clients."""
    return node.p2p.daemon_listen_maddr

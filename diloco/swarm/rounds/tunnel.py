"""A rank's listener reached over libp2p: a rank that prefers p2pd (``--hv.transport p2pd``) and can be dialled takes
the round connections (``tcp``) of ranks that prefer it too as libp2p streams through its p2pd daemon, which brings
what p2pd is chosen for (libp2p's encryption) to groups of any shape; every other pair uses TCP. Not a way past two
routers: the daemon's relays reset a relayed connection after 96 KiB (docs/outer-step.md, "Behind a router").

A libp2p stream reaches this process as a Unix socket connected to the p2pd daemon, opened by hivemind's asyncio
client. Once the stream is set up, that socket is taken off the asyncio loop and handed over as a plain blocking
socket, so those protocols' socket code runs unchanged and their bytes go straight between their thread and the
daemon, with no copy through Python on the way: the socket of an incoming stream goes to the rank's ``Listener`` as
if it had been accepted there, and ``connect`` returns the socket of an outgoing one. Dialled over libp2p, a rank's
endpoint is its libp2p peer id: ``((peer id,), 0)``.

The streams are set up on one thread's asyncio loop with a replica of the DHT's libp2p peer (the same daemon, so
the same peer id). hivemind is pinned to 1.1.12; this relies on ``DHT.run_coroutine``, ``DHTNode.p2p``, and
``P2P``'s ``replicate``, ``daemon_listen_maddr``, ``add_binary_stream_handler``, ``remove_binary_stream_handler``,
``call_binary_stream_handler``, ``peer_id`` and ``shutdown``; and on the streams being asyncio streams over a socket
(``StreamReader``'s read-ahead buffer is taken over with it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from diloco.swarm.rounds.listener import Listener
from diloco.swarm.rounds.tcp import Endpoint, close_socket

log = logging.getLogger("diloco")

PROTOCOL = "/diloco/rank/1"  # the libp2p protocol name of a rank's listener
START_TIMEOUT_S = 30.0


class Tunnel:
    """Hands the libp2p streams to and from this rank's ``listener`` over as sockets; ``close()`` ends every one.

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
        self._handed: weakref.WeakSet[socket.socket] = weakref.WeakSet()  # the streams' sockets, to end on close
        self._handed_lock = threading.Lock()  # added to on the loop, read by close() on the caller's thread
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
        """Stop taking streams, end every stream handed out (their users read end-of-file), and release the daemon
        connection; idempotent."""
        if not self._loop.is_closed():
            if self._loop.is_running():
                with contextlib.suppress(Exception):
                    self._call(self._stop(), 5.0)
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=5.0)
            if not self._loop.is_running():
                self._loop.close()
        with self._handed_lock:
            handed = list(self._handed)
        for sock in handed:  # after the handler was removed: no stream comes in any more
            close_socket(sock)

    # -------------------------------------------------------------------------------- on the tunnel's loop

    async def _start(self, dht: Any) -> str:
        from hivemind.p2p import P2P

        # a replica of our own (``DHT.replicate_p2p`` caches one per process, and another tunnel would close it)
        self._p2p = await P2P.replicate(dht.run_coroutine(_daemon_listen_maddr))
        await self._p2p.add_binary_stream_handler(PROTOCOL, self._accept)
        self._registered = True
        return self._p2p.peer_id.to_base58()

    async def _stop(self) -> None:
        if self._registered:
            with contextlib.suppress(Exception):  # the daemon keeps a handler until told (another tunnel may come)
                await self._p2p.remove_binary_stream_handler(PROTOCOL)
        if self._p2p is not None:
            await self._p2p.shutdown()  # a replica: closes its client, leaves the DHT's daemon running

    async def _accept(self, _info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """An incoming stream: its socket goes to the listener, which reads the hello as for TCP."""
        self.listener.handle(self._take(reader, writer))

    async def _open(self, peer: str, timeout: float) -> socket.socket:
        from hivemind.p2p import PeerID

        try:
            _, reader, writer = await asyncio.wait_for(
                self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), PROTOCOL), timeout
            )
        except Exception as e:  # the daemon's errors (no route, protocol not supported), a bad id, a timeout
            raise ConnectionError(f"no libp2p stream to {peer}: {type(e).__name__}: {e}") from None
        return self._take(reader, writer)

    def _take(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> socket.socket:
        """The stream's socket, off the loop: a duplicate of the transport's descriptor (the transport then closes
        its own), served first with whatever the reader had already read ahead (an incoming stream's hello can
        arrive with its header)."""
        transport = writer.transport
        transport.pause_reading()  # nothing more goes into the reader's buffer
        fd = os.dup(transport.get_extra_info("socket").fileno())
        ahead = bytes(reader._buffer)  # noqa: SLF001 (asyncio keeps no public way to take it)
        reader._buffer.clear()  # noqa: SLF001
        writer.close()  # the request was drained before the stream was set up: nothing is left to write
        sock = socket.socket(fileno=fd) if not ahead else ReadAhead(fd, ahead)
        sock.setblocking(True)
        with self._handed_lock:
            self._handed.add(sock)
        return sock

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


class ReadAhead(socket.socket):
    """A socket whose first bytes received are `ahead` (read from it before it was handed over), then its own."""

    def __init__(self, fileno: int, ahead: bytes):
        super().__init__(fileno=fileno)
        self._ahead = memoryview(ahead)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        if not self._ahead:
            return super().recv(bufsize, flags)
        data, self._ahead = bytes(self._ahead[:bufsize]), self._ahead[bufsize:]
        return data

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        if not self._ahead:
            return super().recv_into(buffer, nbytes, flags)
        view = memoryview(buffer).cast("B")
        n = min(len(self._ahead), nbytes or len(view))
        view[:n] = self._ahead[:n]
        self._ahead = self._ahead[n:]
        return n

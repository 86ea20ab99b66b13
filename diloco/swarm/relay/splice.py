"""Joining two connected sockets: what either receives the other sends, until both directions end."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

CHUNK = 1 << 18  # bytes per read: a round's parts are megabytes, so large reads keep the copies few


def splice(a: socket.socket, b: socket.socket, name: str = "splice", done: Callable[[], None] | None = None) -> None:
    """Copy `a` to `b` and `b` to `a` on two threads of their own; returns at once. Each direction ends at end of
    file or an error, passing the end on (a half close); once both ended, both sockets are closed and `done` is
    called."""
    left = [2]
    lock = threading.Lock()

    def copy(src: socket.socket, dst: socket.socket) -> None:
        try:
            _pump(src, dst)
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                for sock in (a, b):
                    with contextlib.suppress(OSError):
                        sock.close()
                if done is not None:
                    done()

    for src, dst in ((a, b), (b, a)):
        src.settimeout(None)  # a spliced connection is as idle as its users make it (libp2p keeps them open)
        threading.Thread(target=copy, args=(src, dst), daemon=True, name=name).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    try:
        while (n := src.recv_into(view)) > 0:
            dst.sendall(view[:n])
    except OSError:  # a reset on either side: the connection is broken both ways, so end the other direction too
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

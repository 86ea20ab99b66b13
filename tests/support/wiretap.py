"""A machine on the path between peers, for tests: it relays TCP connections, keeps what it saw, may alter a bit."""

from __future__ import annotations

import socket
import threading

from diloco.swarm.rounds.tcp import close_socket


class Wiretap:
    """A relay in front of listeners, as a machine on the path: it keeps every byte it passes and may flip a bit of
    the byte at `flip_at` of each connection's stream to the listener, or at `flip_back_at` of the stream back."""

    def __init__(self, flip_at: int | None = None, flip_back_at: int | None = None) -> None:
        self.flip_at, self.flip_back_at, self.seen, self.lock = flip_at, flip_back_at, bytearray(), threading.Lock()
        self.servers: list[socket.socket] = []

    def relay(self, port: int) -> int:
        server = socket.create_server(("127.0.0.1", 0))
        self.servers.append(server)
        threading.Thread(target=self._accept, args=(server, port), daemon=True).start()
        return server.getsockname()[1]

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def _accept(self, server: socket.socket, port: int) -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", port))
            threading.Thread(target=self._pump, args=(conn, upstream, self.flip_at), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, conn, self.flip_back_at), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, flip_at: int | None) -> None:
        passed = 0
        try:
            while data := bytearray(source.recv(65536)):
                if flip_at is not None and passed <= flip_at < passed + len(data):
                    data[flip_at - passed] ^= 0x01
                passed += len(data)
                with self.lock:
                    self.seen += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            close_socket(sink)

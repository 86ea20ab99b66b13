"""What one rank spends on the connections anyone may open to it (``diloco.swarm.rounds.listener``,
``diloco.swarm.rounds.transfer``) stays bounded: connections past a cap are closed, a thread that cannot start costs
that connection only, hellos and state answers end by their deadlines, concurrent state requests share one copy,
and a keyed request is proven before its runs are read and cannot be replayed. Real sockets on loopback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from diloco.swarm.records.swarm_key import SwarmKey, keygen
from diloco.swarm.rounds import dial, tcp, transfer
from diloco.swarm.rounds.layout import Shape, group_layout
from diloco.swarm.rounds.listener import Listener, listen_socket

torch.set_num_threads(1)

SHAPES = [(1024, 1024), (1024,)]  # 4 MiB of float32 per tensor: more than loopback's socket buffers hold
LAYOUT = group_layout(SHAPES, Shape("FULL_SHARD", 1))


def wait_for(condition: Callable[[], bool], within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the other end closed `sock` within `within` seconds (anything it sent is dropped)."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


@contextmanager
def listening(**caps) -> Iterator[tuple[Listener, int]]:
    listener = Listener(listen_socket("127.0.0.1", 0), 30.0, **caps).start()
    try:
        yield listener, listener._sock.getsockname()[1]
    finally:
        listener.close()


def test_connections_over_the_cap_of_one_host_are_closed_and_another_host_still_gets_in() -> None:
    with listening(max_per_host=3) as (listener, port):
        held = [connect(port) for _ in range(3)]  # silent: each holds a slot until its hello's deadline
        assert wait_for(lambda: listener.open_connections == 3)
        extra = [connect(port) for _ in range(2)]
        assert all(closed_by_peer(sock, 2.0) for sock in extra)
        assert listener.refused == 2 and listener.open_connections == 3
        other = connect(port, source="127.0.0.2")  # another address of this machine: under its own cap
        assert wait_for(lambda: listener.open_connections == 4)
        assert not closed_by_peer(other, 0.3)
        for sock in [*held, *extra, other]:
            sock.close()


def test_connections_over_the_total_cap_are_closed_and_slots_free_again() -> None:
    with listening(max_connections=4) as (listener, port):
        held = [connect(port, source=f"127.0.0.{1 + i}") for i in range(4)]
        assert wait_for(lambda: listener.open_connections == 4)
        extra = connect(port, source="127.0.0.9")
        assert closed_by_peer(extra, 2.0) and listener.refused == 1
        held.pop().close()  # its handler sees the end of the stream: the slot is free again
        assert wait_for(lambda: listener.open_connections == 3)
        again = connect(port, source="127.0.0.9")
        assert wait_for(lambda: listener.open_connections == 4)
        for sock in [*held, extra, again]:
            sock.close()


def test_a_thread_that_cannot_start_costs_its_connection_only(monkeypatch: pytest.MonkeyPatch) -> None:
    served = threading.Event()
    with listening() as (listener, port):
        listener.serve(b"ECHO", lambda conn: (conn.sendall(b"ok"), served.set()))
        start = threading.Thread.start

        def exhausted(thread: threading.Thread) -> None:
            if thread.name == "butterfly-hello":
                raise RuntimeError("can't start new thread")
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", exhausted)
        refused = [connect(port) for _ in range(3)]
        assert all(closed_by_peer(sock, 2.0) for sock in refused)
        assert wait_for(lambda: listener.refused == 3) and listener.open_connections == 0
        monkeypatch.setattr(threading.Thread, "start", start)
        sock = connect(port)  # the accept loop lives on
        sock.sendall(b"ECHO")
        assert sock.recv(2) == b"ok" and served.wait(2.0)
        for sock in [*refused, sock]:
            sock.close()


def test_a_hello_trickled_a_byte_at_a_time_is_cut_at_its_deadline() -> None:
    listener = Listener(listen_socket("127.0.0.1", 0), handshake_timeout=1.0).start()
    try:
        sock = connect(listener._sock.getsockname()[1])
        started = time.monotonic()
        try:
            while time.monotonic() - started < 6.0:  # each byte well within the 1 s a single read may wait
                sock.sendall(tcp.MAGIC[:1])
                time.sleep(0.25)
        except OSError:  # reset: the listener closed it
            pass
        assert closed_by_peer(sock, 6.0 - (time.monotonic() - started))
        assert time.monotonic() - started < 3.0
        assert wait_for(lambda: listener.refused == 1 and listener.open_connections == 0)
        sock.close()
    finally:
        listener.close()


class CountedCopies:
    """A rank's state served from ``SharedCopies``, counting the requests and the copies they cost."""

    def __init__(self) -> None:
        self.tensors = [torch.randn(LAYOUT[0].local_numel), torch.randn(LAYOUT[0].local_numel)]
        self.lock, self.calls = threading.RLock(), 0
        self.shared = transfer.SharedCopies(self.lock)

    def __call__(self) -> transfer.Served:
        with self.lock:
            self.calls += 1
            return {"outer_step": self.calls}, self.shared.get(self.tensors)

    def change(self) -> None:
        """An outer step: the state changes in place, as ``OuterOptimizer`` changes it."""
        with self.lock:
            self.shared.changing()
            for tensor in self.tensors:
                tensor.add_(1.0)


def ask(port: int, runs: list[tuple[int, int]]) -> socket.socket:
    """An open state request for `runs`, sent; its answer left unread."""
    sock = connect(port)
    sock.sendall(transfer.MAGIC + transfer.COUNT.pack(len(runs)) + b"".join(transfer.RUN.pack(*r) for r in runs))
    return sock


def test_concurrent_slow_readers_of_the_state_share_one_copy() -> None:
    state = CountedCopies()
    whole = [(p.start, p.stop) for p in LAYOUT[0].held]
    with listening() as (listener, port):
        listener.serve(transfer.MAGIC, transfer.StateService(LAYOUT[0], state, timeout=10.0))
        readers = [ask(port, whole) for _ in range(8)] + [ask(port, []) for _ in range(4)]  # (0 runs: meta only)
        assert wait_for(lambda: state.calls == 12)
        assert state.shared.copies == 0  # 12 requests, 8 of them stuck mid-answer: they read the live state
        state.change()
        assert state.shared.copies == 1  # the stuck answers now read one copy of the state as it was
        for sock in readers:
            sock.close()
        assert wait_for(lambda: listener.open_connections == 0)
        honest = transfer.download(LAYOUT[0], LAYOUT, [(["127.0.0.1"], port)], timeout=10.0)
        assert honest is not None and all(map(torch.equal, honest[1], state.tensors))
        assert wait_for(lambda: listener.open_connections == 0)  # (its answer closes once the downloader did)
        state.change()
        assert state.shared.copies == 1  # nobody was reading: no copy


def test_an_answer_closing_while_the_state_changes_costs_no_second_copy() -> None:
    """An answer's thread closes it without the state's lock: for a moment it holds no tensors and still counts as
    live (seen once under load: the 8 stuck answers' change cost 2 copies). The change copies the state once, for the
    answers still reading, and nothing for the closing one."""
    lock, tensors = threading.RLock(), [torch.arange(8.0), torch.zeros(8)]
    shared = transfer.SharedCopies(lock)
    reading, closing = shared.get(tensors), shared.get(tensors)
    closing.tensors = []  # what `close` in another thread has written so far (`live` comes next)
    with lock:
        shared.changing()
    assert shared.copies == 1 and reading.tensors[0] is not tensors[0] and closing.tensors == []


def test_an_answer_reads_the_state_of_its_moment_whatever_changes_after() -> None:
    """Two answers under way when the state changes get one copy of it as it was; an answer begun after the change
    reads the new state, live; an answer nobody holds any more, or one that is over, costs nothing."""
    lock, tensors = threading.RLock(), [torch.arange(8.0), torch.zeros(8)]
    shared = transfer.SharedCopies(lock)
    first, second = shared.get(tensors), shared.get(tensors)
    dropped, ended = shared.get(tensors), shared.get(tensors)
    assert torch.equal(first.read_into(0, 2, torch.empty(3)), torch.tensor([2.0, 3.0, 4.0]))
    del dropped
    ended.close()  # an answer over, whatever still holds it
    with lock:
        shared.changing()
        tensors[0].add_(10.0)
    assert shared.copies == 1 and first.tensors[0] is second.tensors[0] is not tensors[0]
    assert torch.equal(first.read_into(0, 0, torch.empty(8)), torch.arange(8.0))
    assert torch.equal(second.whole()[1], torch.zeros(8))
    after = shared.get(tensors)
    assert torch.equal(after.read_into(0, 0, torch.empty(2)), torch.tensor([10.0, 11.0]))
    with lock:
        shared.changing()  # `after` moves to a copy; `first` and `second` already hold theirs
    assert shared.copies == 2 and after.tensors[0] is not tensors[0]


def test_a_state_answer_to_a_slow_reader_is_cut_at_its_deadline() -> None:
    state = CountedCopies()
    whole = [(p.start, p.stop) for p in LAYOUT[0].held]
    with listening() as (listener, port):
        # 1 s for the request and the answer's small part; 16 MiB at 2**30 bytes/s: 16 ms more
        listener.serve(transfer.MAGIC, transfer.StateService(LAYOUT[0], state, timeout=1.0, min_rate=2**30))
        sock = ask(port, whole)
        started, stop = time.monotonic(), threading.Event()

        def read_slowly() -> None:  # a few KiB every 50 ms: each send of the source goes on well within 1 s
            try:
                while not stop.is_set() and sock.recv(4096):
                    time.sleep(0.05)
            except OSError:
                pass

        reader = threading.Thread(target=read_slowly, daemon=True)
        reader.start()
        # refused: the answer raised (an answer sent whole ends quietly, in ``await_close``)
        assert wait_for(lambda: listener.refused == 1 and listener.open_connections == 0, within=4.0)
        assert time.monotonic() - started < 4.0
        stop.set()
        reader.join(5.0)
        sock.close()


def test_a_download_from_a_source_that_paces_its_answer_ends_by_its_deadline() -> None:
    def trickle(conn: socket.socket) -> None:
        header = b'{"outer_step": 1}'
        conn.sendall(transfer.COUNT.pack(len(header)) + header + transfer.TENSORS.pack(1))
        while True:  # a value at a time, each within the download's per-read timeout
            conn.sendall(b"\0" * 4)
            time.sleep(0.05)

    with listening() as (listener, port):
        listener.serve(transfer.MAGIC, trickle)
        started, refused = time.monotonic(), []
        got = transfer.download(LAYOUT[0], LAYOUT, [(["127.0.0.1"], port)], timeout=1.0, min_rate=2**30,
                                refused=refused.append)  # fmt: skip
        assert got is None and time.monotonic() - started < 3.0
        assert len(refused) == 1 and "Timeout" in refused[0] or "PastDeadline" in refused[0], refused


def swarm_key(tmp_path: Path) -> SwarmKey:
    keygen(tmp_path / "swarm.key")
    return SwarmKey.load(tmp_path / "swarm.key")


class CountingSocket(socket.socket):
    """A socket that counts the bytes read from it and keeps the bytes sent through it."""

    read, sent = 0, b""

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        received = super().recv_into(buffer, nbytes, flags)
        self.read += received
        return received

    def send(self, data, flags: int = 0) -> int:
        count = super().send(data, flags)
        self.sent += bytes(memoryview(data)[:count])
        return count

    def sendall(self, data, flags: int = 0) -> None:
        super().sendall(data, flags)
        self.sent += bytes(data)


def test_a_keyless_state_request_is_refused_after_its_first_56_bytes(tmp_path: Path) -> None:
    """A stranger announces the most runs a request may hold and starts sending them: the source reads the magic
    (the listener), its nonce, the count and the MAC, then stops."""
    service = transfer.StateService(LAYOUT[0], lambda: ({}, []), timeout=2.0, key=swarm_key(tmp_path))
    ours, theirs = socket.socketpair()
    ours = CountingSocket(fileno=ours.detach())
    stranger = b"n" * transfer.NONCE_BYTES + transfer.COUNT.pack(transfer.MAX_RUNS)

    def send() -> None:
        try:
            theirs.recv(transfer.NONCE_BYTES)  # the source's nonce
            theirs.sendall(stranger + b"m" * tcp.MAC_SIZE + b"\1" * transfer.RUN.size * transfer.MAX_RUNS)
        except OSError:  # the source closed
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    with pytest.raises(ConnectionError, match="without this swarm's key"):
        service(ours)
    assert ours.read == transfer.NONCE_BYTES + transfer.COUNT.size + tcp.MAC_SIZE  # + 4 of magic: 56
    tcp.close_socket(ours)
    sender.join(5.0)
    theirs.close()


def test_a_replayed_keyed_state_request_is_refused(tmp_path: Path) -> None:
    key, tensors = swarm_key(tmp_path), [torch.randn(LAYOUT[0].local_numel)]
    with listening() as (listener, port):
        service = transfer.StateService(LAYOUT[0], lambda: ({"outer_step": 1}, tensors), timeout=5.0, key=key)
        listener.serve(service.magic, service)
        recorded: list[CountingSocket] = []

        def recording(endpoint: tcp.Endpoint, timeout: float, handshake: dial.Handshake | None) -> socket.socket:
            recorded.append(CountingSocket(fileno=tcp.connect(endpoint, timeout, handshake).detach()))
            return recorded[-1]

        got = transfer.download(LAYOUT[0], LAYOUT, [(["127.0.0.1"], port)], 5.0, connect=recording, key=key)
        assert got is not None and all(map(torch.equal, got[1], tensors))
        request = recorded[0].sent  # what a machine on the path saw the downloader send
        assert request.startswith(transfer.KEYED_MAGIC) and listener.refused == 0
        replay = connect(port)
        replay.sendall(request)
        answer = bytearray()
        replay.settimeout(5.0)
        try:
            while data := replay.recv(65536):
                answer += data
        except ConnectionResetError:
            pass
        assert len(answer) == transfer.NONCE_BYTES  # a fresh nonce, then nothing: the request's MAC fails it
        assert wait_for(lambda: listener.refused == 1)
        replay.close()

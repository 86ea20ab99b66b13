"""Dialling a rank's announced hosts (``diloco.swarm.rounds.dial``): a host that hangs or answers as the wrong peer
costs the right one no timeout, and a connection nobody uses is closed. Real sockets on loopback: 127.0.0.1 and
127.0.0.2 are two hosts of one port; a host "hangs" as a listener whose accept queue is full does (the kernel drops
the SYN, and the connect times out)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from diloco.swarm.rounds import dial

TIMEOUT = 20.0  # far above what a right host takes, so that a wait for a dead one shows


def listener(stack: ExitStack, host: str, port: int = 0) -> socket.socket:
    sock = stack.enter_context(socket.socket())
    sock.bind((host, port))
    sock.listen(0)
    return sock


def hang(stack: ExitStack, sock: socket.socket) -> None:
    """Fill `sock`'s accept queue (backlog 0 holds one): the next connect to it times out."""
    host, port = sock.getsockname()
    stack.enter_context(socket.create_connection((host, port), timeout=2.0))


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def greeting(expected: bytes) -> dial.Handshake:
    """A handshake that reads the listener's greeting and refuses any other (as the round's tells the right peer)."""

    def handshake(sock: socket.socket) -> socket.socket:
        got = sock.recv(len(expected))
        if got != expected:
            sock.close()
            raise ConnectionError(f"greeted with {got!r}")
        return sock

    return handshake


def test_a_first_host_that_hangs_costs_the_right_one_no_timeout(stack: ExitStack) -> None:
    right = listener(stack, "127.0.0.1")
    port = right.getsockname()[1]
    hang(stack, listener(stack, "127.0.0.2", port))
    started = time.monotonic()
    sock = stack.enter_context(dial.connect((["127.0.0.2", "127.0.0.1"], port), TIMEOUT))
    took = time.monotonic() - started
    assert sock.getpeername() == ("127.0.0.1", port)
    assert took < TIMEOUT / 4, took  # serial dialling waited the whole timeout for 127.0.0.2 first


def greet(stack: ExitStack, server: socket.socket, word: bytes) -> None:
    """`server` greets the next connection with `word` (in a thread of its own, as a peer would)."""

    def run() -> None:
        server.settimeout(TIMEOUT)
        conn, _ = server.accept()
        stack.callback(conn.close)
        conn.sendall(word)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    stack.callback(thread.join, TIMEOUT)


def test_the_wrong_peer_is_refused_by_the_handshake_and_the_next_host_wins(stack: ExitStack) -> None:
    wrong = listener(stack, "127.0.0.2")
    port = wrong.getsockname()[1]
    right = listener(stack, "127.0.0.1", port)
    greet(stack, wrong, b"W")
    greet(stack, right, b"R")
    sock = stack.enter_context(dial.connect((["127.0.0.2", "127.0.0.1"], port), TIMEOUT, greeting(b"R")))
    assert sock.getpeername() == ("127.0.0.1", port)


def test_a_first_host_that_answers_at_once_is_the_only_one_dialled(stack: ExitStack) -> None:
    first = listener(stack, "127.0.0.2")
    port = first.getsockname()[1]
    second = listener(stack, "127.0.0.1", port)
    sock = stack.enter_context(dial.connect((["127.0.0.2", "127.0.0.1"], port), TIMEOUT))
    assert sock.getpeername() == ("127.0.0.2", port)
    time.sleep(3 * dial.STAGGER_S)  # past the second attempt's turn, had it been due
    second.settimeout(0.1)
    with pytest.raises(TimeoutError):
        second.accept()


def test_a_connection_that_arrives_after_the_winner_is_closed(stack: ExitStack) -> None:
    """127.0.0.2 hangs, 127.0.0.1 wins; then 127.0.0.2's queue frees, and the kernel's retried SYN connects the
    attempt still running: nobody uses that connection, and it is closed (its listener reads end-of-file)."""
    late = listener(stack, "127.0.0.2")
    port = late.getsockname()[1]
    hang(stack, late)
    listener(stack, "127.0.0.1", port)
    sock = stack.enter_context(dial.connect((["127.0.0.2", "127.0.0.1"], port), TIMEOUT))
    assert sock.getpeername() == ("127.0.0.1", port)
    late.settimeout(5.0)
    stack.enter_context(late.accept()[0])  # the holder's: the queue has room again
    conn = stack.enter_context(late.accept()[0])  # the attempt's, once its SYN is retried
    conn.settimeout(5.0)
    assert conn.recv(1) == b""


def test_when_no_host_works_the_error_names_each_in_order(stack: ExitStack) -> None:
    held = listener(stack, "127.0.0.1")
    port = held.getsockname()[1]
    hang(stack, held)
    closed = socket.socket()
    closed.bind(("127.0.0.2", port))  # bound, never listening: refused
    stack.enter_context(closed)
    with pytest.raises(ConnectionError) as raised:
        dial.connect((["127.0.0.2", "127.0.0.1"], port), 1.0)
    message = str(raised.value)
    assert message.index(f"127.0.0.2:{port}: ") < message.index(f"127.0.0.1:{port}: timed out"), message
    assert "refused" in message, message


def test_no_address_is_a_connection_error() -> None:
    with pytest.raises(ConnectionError, match="no address"):
        dial.connect(([], 1), 1.0)

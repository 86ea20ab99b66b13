"""diloco.swarm.rounds.tunnel.ReadAhead: a stream's socket handed over with the bytes asyncio had already read from
it serves those first, whichever way it is read."""

from __future__ import annotations

import os
import socket

import pytest

from diloco.swarm.rounds.frames import recv_exact
from diloco.swarm.rounds.tunnel import ReadAhead


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair()
    handed = ReadAhead(os.dup(ours.fileno()), b"hello ")
    ours.close()
    yield handed, theirs
    handed.close()
    theirs.close()


def test_recv_serves_what_was_read_ahead_then_the_socket(pair) -> None:
    handed, theirs = pair
    theirs.sendall(b"world")
    assert handed.recv(4) == b"hell"
    assert handed.recv(100) == b"o "
    assert handed.recv(100) == b"world"


def test_recv_into_fills_across_the_seam(pair) -> None:
    handed, theirs = pair
    theirs.sendall(b"world, and more")
    buffer = bytearray(11)
    handed.settimeout(5.0)
    recv_exact(handed, memoryview(buffer))  # the hello reader: recv_into until full
    assert bytes(buffer) == b"hello world"
    assert handed.recv(100) == b", and more"


def test_writes_and_end_of_file_are_the_socket_s(pair) -> None:
    handed, theirs = pair
    handed.sendall(b"reply")
    assert theirs.recv(100) == b"reply"
    theirs.close()
    assert handed.recv(100) == b"hello "
    assert handed.recv(100) == b""

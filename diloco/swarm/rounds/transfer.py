"""Downloading a worker group's outer state into a group of any shape, rank by rank over the ranks' listeners (over
TCP, or libp2p streams with ``--hv.transport p2pd``: ``diloco.swarm.rounds.tunnel``).

A group that is behind, diverged or just joined loads the swarm's state from a group that holds it, and that group
may be sharded otherwise: its rank r holds other rows than this group's rank r. So each rank of the downloading
group asks every rank of the source group for the canonical runs it needs that the source rank *exchanges*
(``diloco.swarm.rounds.layout``: each value is exchanged by exactly one rank of a group, so no value is asked for twice,
and replicas share the load), and assembles its local buffer of outer parameters and momentum from the answers.
The answers must all describe one state (the same metadata); the caller then checks the assembled state against the
digest in that metadata (``diloco.swarm.rounds.digest``), which proves every rank got all of it.

Wire protocol, one connection per (downloading rank, source rank), opened by the downloader on the source rank's
``listener.Listener``:

* request: ``MAGIC``, the number of runs (u32), then each run's canonical ``[start, stop)`` (u64, u64);
* answer: the metadata as JSON (u32 length first), the number of tensors (u8: the outer parameters, and the
  momentum once there is one), then per tensor the float32 values of every run, in the order asked;
* end: the downloader closes, then the source (``tcp.await_close``).

In an open swarm anyone who reaches the listener may download the state, as with hivemind's own state download.
With a swarm key (``diloco.swarm.records.swarm_key``) the request opens with ``KEYED_MAGIC`` and a random nonce, and
ends with a MAC of nonce and runs. The answer is the source's own random nonce, then sealed messages
(``diloco.swarm.rounds.frames``) under a key derived from the swarm key and both nonces: the metadata, the number of
tensors, and the values in messages of at most ``CHUNK`` bytes. So only key holders download, only from key
holders, nobody on the path reads or alters the state, and the caller's digest check still proves the ranks got
one state whole.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from diloco.swarm.records.swarm_key import SwarmKey
from diloco.swarm.rounds import tcp
from diloco.swarm.rounds.frames import Frames, bytes_of, recv_exact, seal_keys
from diloco.swarm.rounds.layout import RankLayout
from diloco.swarm.rounds.tcp import Endpoint

log = logging.getLogger("diloco")

MAGIC = b"DLS1"
KEYED_MAGIC = b"DLK2"  # (DLK1: before the answers were sealed)
NONCE_BYTES = 16
CHUNK = 2**20  # bytes of values per sealed message
COUNT = struct.Struct("!I")
RUN = struct.Struct("!QQ")
TENSORS = struct.Struct("!B")
MAX_RUNS = 2**20
MAX_META_BYTES = 2**16

State = tuple[dict[str, Any], list[torch.Tensor]]  # (metadata, [outer parameters, momentum?]) of one rank
Run = tuple[int, int, int]  # canonical start, stop, and where the values go in the downloader's buffer


def requests(me: RankLayout, source: Sequence[RankLayout]) -> dict[int, list[Run]]:
    """Per rank of the source group, the runs it exchanges that `me` holds (each of `me`'s values exactly once)."""
    runs = sorted((p.start, p.stop, rank) for rank, layout in enumerate(source) for p in layout.exchanged)
    starts = [start for start, _, _ in runs]
    asked: dict[int, list[Run]] = {}
    for piece in me.held:
        i = max(bisect.bisect_right(starts, piece.start) - 1, 0)
        while i < len(runs) and runs[i][0] < piece.stop:
            start, stop, rank = runs[i]
            lo, hi = max(start, piece.start), min(stop, piece.stop)
            if hi > lo:
                asked.setdefault(rank, []).append((lo, hi, piece.local + lo - piece.start))
            i += 1
    return asked


class StateService:
    """Answers state downloads on this rank's ``listener.Listener`` (``listener.serve(MAGIC, service)``).

    :param layout: this rank's; a run is served when it lies inside one of the runs this rank holds.
    :param provider: this rank's current state (copies, taken at one moment).
    :param timeout: seconds any single read or write of a connection may take.
    :param key: the swarm key; None: an open swarm (serve under ``MAGIC``, else under ``KEYED_MAGIC``: ``magic``).
    """

    def __init__(self, layout: RankLayout, provider: Callable[[], State], timeout: float, key: SwarmKey | None = None):
        self.held, self.provider, self.timeout, self.key = layout.held, provider, timeout, key
        self.magic = MAGIC if key is None else KEYED_MAGIC
        self._starts = [p.start for p in layout.held]

    def local(self, start: int, stop: int) -> int:
        """Where canonical ``[start, stop)`` sits in this rank's buffer; ValueError when it does not hold it all."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or stop > self.held[i].stop or stop <= start:
            raise ValueError(f"[{start}, {stop}) is not held by this rank")
        return self.held[i].local + start - self.held[i].start

    def __call__(self, conn: socket.socket) -> None:
        conn.settimeout(self.timeout)
        nonce = bytes(_receive(conn, NONCE_BYTES)) if self.key is not None else b""
        count_bytes = bytes(_receive(conn, COUNT.size))
        (count,) = COUNT.unpack(count_bytes)
        if count > MAX_RUNS:
            raise ValueError(f"{count} runs asked")
        data = bytes(_receive(conn, count * RUN.size))
        if self.key is not None and not self.key.check(bytes(_receive(conn, tcp.MAC_SIZE)), "state-ask", nonce,
                                                       count_bytes + data):  # fmt: skip
            raise ConnectionError("a state request without this swarm's key")
        asked = [RUN.unpack_from(data, i * RUN.size) for i in range(count)]
        places = [(self.local(start, stop), stop - start) for start, stop in asked]
        meta, tensors = self.provider()
        header = json.dumps(meta).encode()
        values = (bytes_of(tensor.reshape(-1)[local : local + numel]) for tensor in tensors for local, numel in places)
        if self.key is None:
            conn.sendall(COUNT.pack(len(header)) + header + TENSORS.pack(len(tensors)))
            for view in values:
                conn.sendall(view)
        else:
            ours = os.urandom(NONCE_BYTES)
            conn.sendall(ours)
            frames = Frames(conn, send_key=_answer_key(self.key, nonce, ours))
            frames.send(header)
            frames.send(TENSORS.pack(len(tensors)))
            for view in values:
                for at in range(0, view.nbytes, CHUNK):
                    frames.send(view[at : at + CHUNK])
        tcp.await_close(conn, self.timeout)  # the downloader closes first: see ``await_close``


def download(
    me: RankLayout, source: Sequence[RankLayout], endpoints: Sequence[Endpoint], timeout: float,
    connect: tcp.Connect = tcp.connect, key: SwarmKey | None = None, refused: Callable[[str], None] | None = None,
) -> State | None:
    """This rank's outer state (in `me`'s layout) from the ranks of a group laid out as `source`, reached at
    `endpoints` (in rank order) through `connect`, authenticated with the swarm `key` if any. None when a rank does
    not answer in full, the answers describe different states, or (with a key) a rank cannot prove it holds it;
    `refused(why)` is told of each answer refused (one that came, but short, malformed, unproven or unlike the
    others': not an unreachable rank)."""
    outer = torch.empty(me.local_numel)
    made: list[list[torch.Tensor]] = []  # the outer parameters, and the momentum once an answer has one

    def buffers(count: int) -> list[torch.Tensor]:
        if not made:
            if count not in (1, 2):
                raise ValueError(f"{count} tensors in a state")
            made.append([outer] + [torch.empty_like(outer) for _ in range(count - 1)])
        if count != len(made[0]):
            raise ValueError("another state than the other ranks'")
        return made[0]

    meta: dict[str, Any] | None = None
    for rank, runs in (requests(me, source) or {0: []}).items():  # a rank that holds nothing still needs the meta
        try:
            conn = connect(endpoints[rank], timeout, None)
        except OSError as e:
            log.debug("state download: rank %d unreachable: %s: %s", rank, type(e).__name__, e)
            return None
        try:
            got = _fetch(conn, runs, timeout, buffers, key)
        except (OSError, ValueError, UnicodeDecodeError) as e:
            return _refuse(refused, f"rank {rank}'s answer: {type(e).__name__}: {e}")
        if meta is not None and got != meta:
            return _refuse(refused, f"rank {rank} sent another state than the others")
        meta = got
    return None if meta is None else (meta, made[0] if made else [outer])


def _refuse(refused: Callable[[str], None] | None, why: str) -> None:
    log.debug("state download refused: %s", why)
    if refused is not None:
        refused(why)


def _fetch(sock: socket.socket, runs: list[Run], timeout: float, buffers: Callable[[int], list[torch.Tensor]],
           key: SwarmKey | None = None) -> dict[str, Any]:  # fmt: skip
    """Ask one source rank, connected on `sock` (closed after), for `runs`; its values go into ``buffers(count)`` at
    the runs' places."""
    sock.settimeout(timeout)
    try:
        asked = COUNT.pack(len(runs)) + b"".join(RUN.pack(start, stop) for start, stop, _ in runs)
        if key is None:
            nonce, request = b"", MAGIC + asked
        else:
            nonce = os.urandom(NONCE_BYTES)
            request = KEYED_MAGIC + nonce + asked + key.mac("state-ask", nonce, asked)
        sock.sendall(request)
        if key is None:
            (length,) = COUNT.unpack(_receive(sock, COUNT.size))
            if length > MAX_META_BYTES:
                raise ValueError(f"metadata of {length} bytes")
            meta = _meta(bytes(_receive(sock, length)))
            (count,) = TENSORS.unpack(_receive(sock, TENSORS.size))
            for tensor in buffers(count):
                for start, stop, local in runs:
                    recv_exact(sock, bytes_of(tensor[local : local + stop - start]))
            return meta
        # a source without the key fails the first seal: "a message that fails its seal"
        frames = Frames(sock, receive_key=_answer_key(key, nonce, bytes(_receive(sock, NONCE_BYTES))))
        meta = _meta(bytes(frames.receive(MAX_META_BYTES)))
        (count,) = TENSORS.unpack(frames.receive(TENSORS.size))
        for tensor in buffers(count):
            for start, stop, local in runs:
                view = bytes_of(tensor[local : local + stop - start])
                for at in range(0, view.nbytes, CHUNK):
                    frames.receive_into(view[at : at + CHUNK])
        return meta
    finally:
        sock.close()


def _answer_key(key: SwarmKey, asked: bytes, answered: bytes) -> bytes:
    """The key a keyed answer is sealed under: the request's nonce and the answer's make it fresh."""
    return seal_keys(key.mac("state-seal"), asked + answered)[1]


def _meta(header: bytes) -> dict[str, Any]:
    """A state's metadata as a source sent it: a JSON object (its fields are the outer loop's to check:
    ``diloco.outer.catchup``); anything else is a ValueError, and the answer is refused."""
    try:
        meta = json.loads(header.decode())
    except RecursionError:  # nesting deeper than Python's recursion limit: a hostile answer, not a state
        raise ValueError("metadata nested too deep") from None
    if not isinstance(meta, dict):
        raise ValueError("metadata that is not an object")
    return meta


def _receive(sock: socket.socket, size: int) -> memoryview:
    data = bytearray(size)
    recv_exact(sock, memoryview(data))
    return memoryview(data)

"""Downloading a worker group's outer state into a group of any shape, rank by rank over the ranks' listeners (over
TCP, whatever the groups' ``--hv.transport``).

A group that is behind, diverged or just joined loads the swarm's state from a group that holds it, and that group
may be sharded otherwise: its rank r holds other rows than this group's rank r. So each rank of the downloading
group asks every rank of the source group for the canonical runs it needs that the source rank *exchanges*
(``diloco.swarm.rounds.layout``: each value is exchanged by exactly one rank of a group, so no value is asked for twice,
and replicas share the load), and assembles its local buffer of outer parameters and momentum from the answers.
The answers must all describe one state (the same metadata); the caller then checks the assembled state against the
digest in that metadata (``diloco.swarm.rounds.digest``), which proves every rank got all of it.

Wire protocol, one connection per (downloading rank, source rank), opened by the downloader on the source rank's
``listener.Listener``:

* request: ``MAGIC``, the number of runs (u32, at most ``MAX_RUNS``), then each run's canonical ``[start, stop)``
  (u64, u64);
* answer: the metadata as JSON (u32 length first), the number of tensors (u8: the outer parameters, and the
  momentum once there is one), then per tensor the float32 values of every run, in the order asked;
* end: the downloader closes, then the source (``tcp.await_close``).

In an open swarm anyone who reaches the listener may download the state, as with hivemind's own state download.
With a swarm key (``diloco.swarm.records.swarm_key``) the source answers ``KEYED_MAGIC`` with a random nonce of its
own; the downloader sends its random nonce, the number of runs and a MAC of both nonces and that number, which the
source checks before it reads any run; then the runs and a MAC of everything. The answer is sealed messages
(``diloco.swarm.rounds.frames``) under a key derived from the swarm key and both nonces: the metadata, the number of
tensors, and the values in messages of at most ``CHUNK`` bytes. So only key holders download, only from key
holders, nobody on the path reads or alters the state, a recorded request fails the next source nonce, a stranger
gets no more than 56 bytes read, and the caller's digest check still proves the ranks got one state whole.

What a request costs the source is bounded: an answer reads the live state a chunk at a time, and only when the
state is about to change while answers are still reading it do they get a copy, one shared by all of them
(``SharedCopies``); every request ends by a deadline (``StateService``), as does every download.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ContextManager

import torch

from diloco.swarm.records.swarm_key import SwarmKey
from diloco.swarm.rounds import tcp
from diloco.swarm.rounds.frames import Frames, bytes_of, recv_exact, seal_keys, send_all
from diloco.swarm.rounds.layout import RankLayout
from diloco.swarm.rounds.tcp import Endpoint

log = logging.getLogger("diloco")

MAGIC = b"DLS1"
KEYED_MAGIC = b"DLK3"  # (DLK2: the request's MAC came after its runs, and it had no source nonce)
NONCE_BYTES = 16
CHUNK = 2**20  # bytes of values per sealed message
COUNT = struct.Struct("!I")
RUN = struct.Struct("!QQ")
TENSORS = struct.Struct("!B")
# runs of one request: one or a few per parameter tensor of the source rank's shard, so a model needs far fewer;
# it bounds what an open request makes the source read (1 MiB)
MAX_RUNS = 2**16
RUNS_READ = 2**16  # bytes of runs read at a time: the buffer grows with what the peer sent, not with what it claims
MAX_META_BYTES = 2**16
MIN_RATE = 2**20  # bytes/s: a reader or sender slower than this over a whole answer is cut off at its deadline

State = tuple[dict[str, Any], list[torch.Tensor]]  # (metadata, [outer parameters, momentum?]) of one rank
Served = tuple[dict[str, Any], "list[torch.Tensor] | Frozen"]  # a state as a provider gives it to `StateService`
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


class Frozen:
    """A state's tensors as of one moment, as an answer reads them (``SharedCopies``): the live tensors, read a chunk
    at a time under the state's `lock`, until the state is about to change; from then on a copy taken just before."""

    def __init__(self, tensors: list[torch.Tensor], lock: ContextManager[Any]) -> None:
        self.tensors, self.lock, self.live = tensors, lock, True

    @classmethod
    def of(cls, tensors: list[torch.Tensor] | Frozen) -> Frozen:
        """`tensors` as an answer reads them: itself when it is one, else tensors nothing changes (no lock)."""
        return tensors if isinstance(tensors, Frozen) else cls(list(tensors), contextlib.nullcontext())

    def __len__(self) -> int:
        return len(self.tensors)

    def whole(self) -> list[torch.Tensor]:
        """Copies of the tensors, whole."""
        with self.lock:
            return [tensor.clone() for tensor in self.tensors]

    def read_into(self, index: int, start: int, out: torch.Tensor) -> torch.Tensor:
        """`out` filled with the values of flat tensor `index` from `start` on (so the state may change once it
        returns). An answer reads into one buffer of its own, chunk after chunk: many answers at once then hold a
        chunk each, allocated once, instead of allocating and freeing one per chunk read from many threads."""
        # a copy nothing changes needs no wait for the state's lock (an outer step holds it)
        with self.lock if self.live else contextlib.nullcontext():
            return out.copy_(self.tensors[index].reshape(-1)[start : start + out.numel()])

    def close(self) -> None:
        """The answer is over (sent, or failed): no copy is taken for it any more."""
        self.tensors, self.live = [], False


class SharedCopies:
    """What the answers to state downloads read, at no copy while the state holds still: each request gets the live
    tensors (``get``, under the state's lock, with the metadata of the same moment). Just before the state changes in
    place (``changing``, under the lock), the answers still reading get one copy of it, taken then and shared by all
    of them, so N slow readers cost one copy at most, and none when no change comes during their answers. A copy
    nobody reads any more is freed at once."""

    def __init__(self, lock: ContextManager[Any] | None = None) -> None:
        self.lock = lock if lock is not None else threading.RLock()  # the state's own: its changes hold it
        self.copies = 0  # copies taken (what the requests cost)
        self._readers: weakref.WeakSet[Frozen] = weakref.WeakSet()

    def get(self, tensors: list[torch.Tensor]) -> Frozen:
        """The state `tensors` (live: not copies) for one answer. Call under the lock."""
        frozen = Frozen(list(tensors), self.lock)
        self._readers.add(frozen)
        return frozen

    def changing(self) -> None:
        """The state is about to change in place: the answers still reading it move to a copy. Call under the
        lock, before the change."""
        copies: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for frozen in [f for f in self._readers if f.live]:
            tensors = frozen.tensors  # (an answer's thread closes it without the lock: read it once)
            if not tensors:  # closed meanwhile: nothing to copy for it
                continue
            key = tuple(id(tensor) for tensor in tensors)
            if key not in copies:
                copies[key] = [tensor.clone() for tensor in tensors]
                self.copies += 1
            frozen.tensors, frozen.live = copies[key], False


class StateService:
    """Answers state downloads on this rank's ``listener.Listener`` (``listener.serve(MAGIC, service)``).

    :param layout: this rank's; a run is served when it lies inside one of the runs this rank holds.
    :param provider: this rank's current state (the metadata and tensors of one moment), called once per request:
        its live tensors through ``SharedCopies.get`` (no copy unless the state changes mid-answer), or tensors
        nothing changes.
    :param timeout: seconds any single read or write of a connection may take, and the whole request.
    :param key: the swarm key; None: an open swarm (serve under ``MAGIC``, else under ``KEYED_MAGIC``: ``magic``).
    :param min_rate: bytes/s: each answer ends by `timeout` + its bytes / `min_rate` after it starts, and a
        downloader reading slower is cut off (its download fails: "PastDeadline" at debug level).
    """

    def __init__(self, layout: RankLayout, provider: Callable[[], Served], timeout: float, key: SwarmKey | None = None,
                 min_rate: float = MIN_RATE):  # fmt: skip
        self.held, self.provider, self.timeout, self.key, self.min_rate = layout.held, provider, timeout, key, min_rate
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
        deadline = time.monotonic() + self.timeout  # the request; the answer gets its own by its size
        if self.key is None:
            nonces, data = (b"", b""), _read_runs(conn, _count(_receive(conn, COUNT.size, deadline)), deadline)
        else:
            nonces, data = self._keyed_request(conn, deadline)
        places = [(self.local(start, stop), stop - start) for start, stop in _runs(data)]
        meta, tensors = self.provider()
        state = Frozen.of(tensors)
        header = json.dumps(meta).encode()
        nbytes = sum(numel for _, numel in places) * 4 * len(state)
        deadline = time.monotonic() + self.timeout + nbytes / self.min_rate  # a slow reader is cut off here
        step = CHUNK // 4  # values per piece read (and per sealed message)
        buffer = torch.empty(min(step, max((n for _, n in places), default=0)), dtype=torch.float32)  # each piece
        values = (bytes_of(state.read_into(i, local + at, buffer[: min(step, numel - at)]))
                  for i in range(len(state)) for local, numel in places for at in range(0, numel, step))  # fmt: skip
        try:
            if self.key is None:
                send_all(conn, COUNT.pack(len(header)) + header + TENSORS.pack(len(state)), deadline)
                for view in values:
                    send_all(conn, view, deadline)
            else:
                frames = Frames(conn, send_key=_answer_key(self.key, *nonces), deadline=deadline)
                frames.send(header)
                frames.send(TENSORS.pack(len(state)))
                for view in values:
                    frames.send(view)
        finally:  # (a failed answer's frame may outlive it in a traceback: it must not hold or cost a copy)
            state.close()
        del tensors, state, values, buffer  # (a copy nobody reads is freed: see ``SharedCopies``)
        tcp.await_close(conn, max(0.0, min(self.timeout, deadline - time.monotonic())))

    def _keyed_request(self, conn: socket.socket, deadline: float) -> tuple[tuple[bytes, bytes], bytes]:
        """((the downloader's nonce, ours), the runs' bytes) of a keyed request, proven before its runs are read."""
        ours = os.urandom(NONCE_BYTES)
        send_all(conn, ours, deadline)
        head = bytes(_receive(conn, NONCE_BYTES + COUNT.size + tcp.MAC_SIZE, deadline))
        theirs, count_bytes, mac = head[:NONCE_BYTES], head[NONCE_BYTES:-tcp.MAC_SIZE], head[-tcp.MAC_SIZE :]
        if not self.key.check(mac, "state-ask", ours, theirs, count_bytes):  # a stranger, or a replayed request
            raise ConnectionError("a state request without this swarm's key")
        data = _read_runs(conn, _count(count_bytes), deadline)
        if not self.key.check(bytes(_receive(conn, tcp.MAC_SIZE, deadline)), "state-runs", ours, theirs, count_bytes,
                              data):  # fmt: skip
            raise ConnectionError("a state request whose runs fail their MAC")
        return (theirs, ours), data


def download(
    me: RankLayout, source: Sequence[RankLayout], endpoints: Sequence[Endpoint], timeout: float,
    connect: tcp.Connect = tcp.connect, key: SwarmKey | None = None, refused: Callable[[str], None] | None = None,
    min_rate: float = MIN_RATE, wanted: Callable[[dict[str, Any]], bool] | None = None,
) -> State | None:
    """This rank's outer state (in `me`'s layout) from the ranks of a group laid out as `source`, reached at
    `endpoints` (in rank order) through `connect`, authenticated with the swarm `key` if any. None when a rank does
    not answer in full, the answers describe different states, or (with a key) a rank cannot prove it holds it;
    `refused(why)` is told of each answer refused (one that came, but short, malformed, unproven or unlike the
    others': not an unreachable rank). All of it ends by one deadline: `timeout` per rank asked, plus the state's
    bytes (momentum included) at `min_rate` bytes/s, so sources that pace their bytes cannot hold it longer.
    `wanted(meta)`: whether the state an answer's metadata describes is the one asked for; when it is not, the
    download stops there and returns that metadata with no tensors (nothing is received, no buffer is filled)."""
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

    asked = requests(me, source) or {0: []}  # a rank that holds nothing still needs the meta
    deadline = time.monotonic() + timeout * len(asked) + 2 * 4 * me.local_numel / min_rate
    meta: dict[str, Any] | None = None
    for rank, runs in asked.items():
        try:
            conn = connect(endpoints[rank], max(0.0, min(timeout, deadline - time.monotonic())), None)
        except OSError as e:
            log.debug("state download: rank %d unreachable: %s: %s", rank, type(e).__name__, e)
            return None
        try:
            got = _fetch(conn, runs, timeout, buffers, key, deadline, wanted)
        except Unwanted as e:
            return e.meta, []
        except (OSError, ValueError, UnicodeDecodeError) as e:  # (PastDeadline is a TimeoutError)
            return _refuse(refused, f"rank {rank}'s answer: {type(e).__name__}: {e}")
        if meta is not None and got != meta:
            return _refuse(refused, f"rank {rank} sent another state than the others")
        meta = got
    return None if meta is None else (meta, made[0] if made else [outer])


def _refuse(refused: Callable[[str], None] | None, why: str) -> None:
    log.debug("state download refused: %s", why)
    if refused is not None:
        refused(why)


class Unwanted(Exception):
    """An answer whose metadata describes another state than the one asked for (``download``'s `wanted`)."""

    def __init__(self, meta: dict[str, Any]) -> None:
        super().__init__("another state than the one asked for")
        self.meta = meta


def _fetch(sock: socket.socket, runs: list[Run], timeout: float, buffers: Callable[[int], list[torch.Tensor]],
           key: SwarmKey | None = None, deadline: float | None = None,
           wanted: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:  # fmt: skip
    """Ask one source rank, connected on `sock` (closed after), for `runs`, by `deadline` (``time.monotonic()``);
    its values go into ``buffers(count)`` at the runs' places. ``Unwanted`` when `wanted` refuses the metadata."""
    sock.settimeout(timeout)
    try:
        count = COUNT.pack(len(runs))
        asked = b"".join(RUN.pack(start, stop) for start, stop, _ in runs)
        if key is None:
            send_all(sock, MAGIC + count + asked, deadline)
            (length,) = COUNT.unpack(_receive(sock, COUNT.size, deadline))
            if length > MAX_META_BYTES:
                raise ValueError(f"metadata of {length} bytes")
            meta = _checked(_meta(bytes(_receive(sock, length, deadline))), wanted)
            (tensors,) = TENSORS.unpack(_receive(sock, TENSORS.size, deadline))
            for tensor in buffers(tensors):
                for start, stop, local in runs:
                    recv_exact(sock, bytes_of(tensor[local : local + stop - start]), deadline)
            return meta
        send_all(sock, KEYED_MAGIC, deadline)
        theirs, ours = bytes(_receive(sock, NONCE_BYTES, deadline)), os.urandom(NONCE_BYTES)
        proof = key.mac("state-ask", theirs, ours, count)
        send_all(sock, ours + count + proof + asked + key.mac("state-runs", theirs, ours, count, asked), deadline)
        # a source without the key fails the first seal: "a message that fails its seal"
        frames = Frames(sock, receive_key=_answer_key(key, ours, theirs), deadline=deadline)
        meta = _checked(_meta(bytes(frames.receive(MAX_META_BYTES))), wanted)
        (tensors,) = TENSORS.unpack(frames.receive(TENSORS.size))
        for tensor in buffers(tensors):
            for start, stop, local in runs:
                view = bytes_of(tensor[local : local + stop - start])
                for at in range(0, view.nbytes, CHUNK):
                    frames.receive_into(view[at : at + CHUNK])
        return meta
    finally:
        sock.close()


def _checked(meta: dict[str, Any], wanted: Callable[[dict[str, Any]], bool] | None) -> dict[str, Any]:
    """`meta`, unless `wanted` refuses it (``Unwanted``): then no values of the answer are read."""
    if wanted is not None and not wanted(meta):
        raise Unwanted(meta)
    return meta


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


def _receive(sock: socket.socket, size: int, deadline: float | None = None) -> memoryview:
    data = bytearray(size)
    recv_exact(sock, memoryview(data), deadline)
    return memoryview(data)


def _count(count_bytes: bytes | memoryview) -> int:
    """The number of runs a request announces; ValueError past ``MAX_RUNS``."""
    (count,) = COUNT.unpack(count_bytes)
    if count > MAX_RUNS:
        raise ValueError(f"{count} runs asked (at most {MAX_RUNS})")
    return count


def _read_runs(sock: socket.socket, count: int, deadline: float) -> bytes:
    """The `count` runs of a request, read a slice at a time: a peer that claims many and sends few costs few."""
    data, left = bytearray(), count * RUN.size
    while left:
        part = _receive(sock, min(left, RUNS_READ), deadline)
        data += part
        left -= part.nbytes
    return bytes(data)


def _runs(data: bytes) -> Iterator[tuple[int, int]]:
    for at in range(0, len(data), RUN.size):
        yield RUN.unpack_from(data, at)

"""State downloads between groups of different shapes (`diloco.swarm.rounds.transfer`) over real loopback sockets: every
rank of the downloading group assembles exactly its rows from the ranks of a group sharded otherwise."""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from diloco.swarm.rounds import tcp, transfer
from diloco.swarm.rounds.digest import CanonicalDigest
from diloco.swarm.rounds.layout import RankLayout, Shape, group_layout
from diloco.swarm.rounds.listener import Listener, listen_socket

SHAPES = [(64, 32), (32,), (33, 16), (7, 3), (5,), (10, 64)]
TOTAL = sum(math.prod(s) for s in SHAPES)


def local(vector: torch.Tensor, rank: RankLayout) -> torch.Tensor:
    return torch.cat([vector[p.start : p.stop] for p in rank.held]) if rank.held else torch.zeros(0)


@contextmanager
def serving(shape: Shape, tensors: list[torch.Tensor], meta: dict,
            key: object = None) -> Iterator[list[transfer.Endpoint]]:  # fmt: skip
    """A group of `shape` whose ranks serve their shards of `tensors` (canonical vectors) on loopback listeners
    (with the swarm key `key`, if any)."""
    listeners, endpoints = [], []
    try:
        for layout in group_layout(SHAPES, shape):
            sock = listen_socket("127.0.0.1", 0)
            listener = Listener(sock, handshake_timeout=10).start()
            state = (meta, [local(t, layout) for t in tensors])
            service = transfer.StateService(layout, lambda s=state: s, timeout=10, key=key)  # type: ignore[arg-type]
            listener.serve(service.magic, service)
            listeners.append(listener)
            endpoints.append((["127.0.0.1"], sock.getsockname()[1]))
        yield endpoints
    finally:
        for listener in listeners:
            listener.close()


SOURCES = [Shape("FULL_SHARD", 1), Shape("FULL_SHARD", 3), Shape("NO_SHARD", 2), Shape("HYBRID_SHARD", 4, nodes=2)]
TARGETS = [Shape("FULL_SHARD", 1), Shape("FULL_SHARD", 2), Shape("SHARD_GRAD_OP", 5), Shape("DDP", 2)]


@pytest.mark.parametrize("source", SOURCES, ids=lambda s: f"{s.strategy}-{s.world_size}")
def test_every_rank_of_any_shape_downloads_its_rows_and_momentum_from_any_shape(source: Shape) -> None:
    outer, momentum = torch.randn(TOTAL), torch.randn(TOTAL)
    meta = {"outer_step": 3, "step": 12, "digest": "d"}
    with serving(source, [outer, momentum], meta) as endpoints:
        for target in TARGETS:
            layouts = group_layout(SHAPES, target)
            for layout in layouts:
                got = transfer.download(layout, group_layout(SHAPES, source), endpoints, timeout=10)
                assert got is not None, (target, layout)
                assert got[0] == meta
                assert torch.equal(got[1][0], local(outer, layout)) and torch.equal(got[1][1], local(momentum, layout))
            # what the caller checks before loading: the assembled state's digest is the source's
            digests = [CanonicalDigest(SHAPES, r) for r in layouts]
            parts = [d.partial(transfer.download(r, group_layout(SHAPES, source), endpoints, 10)[1][0])
                     for d, r in zip(digests, layouts)]  # fmt: skip
            whole = CanonicalDigest(SHAPES, group_layout(SHAPES, Shape("FULL_SHARD", 1))[0]).partial(outer)
            assert CanonicalDigest.combine(parts) == CanonicalDigest.combine([whole])


def test_each_value_is_asked_of_exactly_one_source_rank_and_replicas_share_the_asking() -> None:
    me = group_layout(SHAPES, Shape("FULL_SHARD", 1))[0]
    asked = transfer.requests(me, group_layout(SHAPES, Shape("NO_SHARD", 3)))
    assert sorted(asked) == [0, 1, 2]  # all three replicas
    values = sorted(i for runs in asked.values() for start, stop, _ in runs for i in range(start, stop))
    assert values == list(range(TOTAL))


def test_a_state_without_momentum_and_a_rank_that_holds_nothing() -> None:
    outer = torch.randn(TOTAL)
    with serving(Shape("FULL_SHARD", 2), [outer], {"outer_step": 0}) as endpoints:
        empty = RankLayout((), ())  # FSDP can leave a rank without rows
        got = transfer.download(empty, group_layout(SHAPES, Shape("FULL_SHARD", 2)), endpoints, timeout=10)
        assert got is not None and got[0] == {"outer_step": 0} and [t.numel() for t in got[1]] == [0]


def test_sources_that_disagree_or_vanish_give_no_state() -> None:
    layout = group_layout(SHAPES, Shape("FULL_SHARD", 1))[0]
    source = group_layout(SHAPES, Shape("FULL_SHARD", 2))
    outer = torch.randn(TOTAL)
    with serving(Shape("FULL_SHARD", 2), [outer], {"outer_step": 1}) as endpoints:
        with serving(Shape("FULL_SHARD", 2), [outer], {"outer_step": 2}) as later:
            disagree: list[str] = []
            got = transfer.download(layout, source, [endpoints[0], later[1]], timeout=10, refused=disagree.append)
            assert got is None and len(disagree) == 1 and "another state" in disagree[0]
    refused: list[str] = []
    assert transfer.download(layout, source, endpoints, timeout=2, refused=refused.append) is None  # nobody answers
    assert refused == []  # unreachable is not refused


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "keyed"])
def test_an_answer_of_another_state_than_the_one_asked_for_stops_at_its_metadata(keyed: bool) -> None:
    """`wanted` refuses the metadata (the source moved on): the download returns it with no tensors, having
    received none of the values; the state asked for downloads whole."""
    from diloco.swarm.records.swarm_key import SwarmKey

    key = SwarmKey(b"k" * 32) if keyed else None
    layout, source = group_layout(SHAPES, Shape("FULL_SHARD", 1))[0], group_layout(SHAPES, Shape("FULL_SHARD", 2))
    outer, asked = torch.randn(TOTAL), []
    with serving(Shape("FULL_SHARD", 2), [outer, outer], {"outer_step": 4}, key) as endpoints:
        def wanted(meta: dict) -> bool:
            asked.append(meta["outer_step"])
            return meta["outer_step"] == 3

        got = transfer.download(layout, source, endpoints, timeout=10, key=key, wanted=wanted)
        assert got == ({"outer_step": 4}, []) and asked == [4]  # the first rank's metadata: no second rank asked
        whole = transfer.download(layout, source, endpoints, timeout=10, key=key, wanted=lambda meta: True)
        assert whole is not None and torch.equal(whole[1][0], outer)


def test_a_request_for_values_a_rank_does_not_hold_is_dropped() -> None:
    outer = torch.randn(TOTAL)
    with serving(Shape("FULL_SHARD", 2), [outer], {"outer_step": 1}) as endpoints:
        with socket.create_connection(tuple([endpoints[0][0][0], endpoints[0][1]]), timeout=10) as sock:
            sock.sendall(transfer.MAGIC + transfer.COUNT.pack(1) + transfer.RUN.pack(0, TOTAL))  # rank 0 holds half
            assert sock.recv(1) == b""  # closed without an answer


class Probe(socket.socket):
    """A downloader's socket that, when closed, first looks whether the source still holds its end open."""

    source_open: bool | None = None

    def close(self) -> None:
        if self.source_open is None:
            self.settimeout(0.5)
            try:
                self.source_open = self.recv(1) != b""
            except TimeoutError:
                self.source_open = True
        super().close()


def test_a_source_closes_only_after_the_downloader_did() -> None:
    """The downloader has every value before the source closes (``tcp.await_close``; over p2pd, a source that closed
    first could have its daemon reset the stream under the last bytes)."""
    outer = torch.randn(TOTAL)
    probes: list[Probe] = []

    def connect(endpoint, timeout, handshake):
        probes.append(Probe(fileno=tcp.connect(endpoint, timeout).detach()))
        return probes[-1]

    with serving(Shape("FULL_SHARD", 1), [outer], {"outer_step": 1}) as endpoints:
        layout = group_layout(SHAPES, Shape("FULL_SHARD", 1))
        got = transfer.download(layout[0], layout, endpoints, timeout=10, connect=connect)
    assert got is not None and torch.equal(got[1][0], outer)
    assert [probe.source_open for probe in probes] == [True]


@pytest.mark.parametrize("answer", ["short", "three tensors", "huge metadata"])
def test_a_source_that_answers_the_wrong_size_gives_no_state(answer: str) -> None:
    """A hostile or broken source rank: fewer values than asked (then it hangs up), a third tensor, or a metadata
    length of 4 GiB. The download gives up (None) in bounded time, without allocating what it was told."""
    layout = group_layout(SHAPES, Shape("FULL_SHARD", 1))[0]
    source = group_layout(SHAPES, Shape("FULL_SHARD", 1))
    server = listen_socket("127.0.0.1", 0)

    def lie(conn: socket.socket) -> None:
        header = b'{"outer_step": 9}'
        if answer == "huge metadata":
            conn.sendall(transfer.COUNT.pack(2**32 - 1))
        else:
            count = 3 if answer == "three tensors" else 1
            conn.sendall(transfer.COUNT.pack(len(header)) + header + transfer.TENSORS.pack(count))
            conn.sendall(b"\0" * (4 * TOTAL // 2))  # half the values asked for

    listener = Listener(server, handshake_timeout=10).start()
    listener.serve(transfer.MAGIC, lie)
    try:
        started = time.monotonic()
        refused: list[str] = []
        endpoints = [(["127.0.0.1"], server.getsockname()[1])]
        assert transfer.download(layout, source, endpoints, timeout=2, refused=refused.append) is None
        assert time.monotonic() - started < 10
        assert len(refused) == 1  # counted (summary.json's `rejected_states`)
    finally:
        listener.close()

"""Rounds and state downloads over libp2p streams (`diloco.swarm.rounds.tunnel`): each rank a real DHT peer with its p2pd
daemon on loopback, its listener reached only through the daemon (no TCP listening socket at all)."""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from diloco.swarm.records.dht import start_dht, visible_maddrs
from diloco.swarm.rounds import transfer
from diloco.swarm.rounds.codecs import WIRE_FORMATS
from diloco.swarm.rounds.layout import Shape, group_layout, plan, plan_schedule
from diloco.swarm.rounds.listener import Listener
from diloco.swarm.rounds.tcp import Round, RoundFailed
from diloco.swarm.rounds.tunnel import Tunnel
from tests.support.dht import LOCAL, shutdown_dht

torch.set_num_threads(1)

SHAPES = [(300, 40), (40,), (123, 40), (7,), (5, 3, 2)]
TOTAL = sum(math.prod(s) for s in SHAPES)
# seconds a step of a round may take (the trainer's default is 60): under the suite's load three p2pd daemons and
# the test's threads share 2 cores, and a reducer that waits longer for a part drops its sender, who then fails
TIMEOUT = 30


@dataclasses.dataclass
class Rank:
    """One rank's DHT peer, listener (no socket of its own) and tunnel."""

    dht: object
    listener: Listener
    tunnel: Tunnel

    @property
    def endpoint(self) -> tuple[tuple[str], int]:
        return (self.tunnel.peer_id,), 0


@pytest.fixture(scope="module")
def ranks() -> Iterator[list[Rank]]:
    """Three ranks in one swarm: a 1-rank group's and a 2-rank group's, say."""
    made: list[Rank] = []
    dhts = []
    try:
        for _ in range(3):
            peers = visible_maddrs(dhts[0]) if dhts else []
            dhts.append(start_dht(initial_peers=peers, host_maddrs=LOCAL, announce_maddrs=[]))
            listener = Listener(None, handshake_timeout=TIMEOUT).start()
            made.append(Rank(dhts[-1], listener, Tunnel(dhts[-1], listener)))
        yield made
    finally:
        for rank in made:
            rank.tunnel.close()
            rank.listener.close()
        leftover = [pid for dht in dhts for pid in shutdown_dht(dht)]
        assert leftover == []


def local(vector: torch.Tensor, layout) -> torch.Tensor:
    return torch.cat([vector[p.start : p.stop] for p in layout.held])


@pytest.mark.parametrize("compression", ["none", "fp16", "int8", "int4"])
def test_a_one_rank_and_a_two_rank_group_average_bit_identically_over_libp2p(ranks: list[Rank], compression: str):
    codec = dataclasses.replace(WIRE_FORMATS[compression].tcp, part_numel=1000)  # many parts across the shards
    mix = [Shape("FULL_SHARD", 1), Shape("FULL_SHARD", 2)]
    layouts = [group_layout(SHAPES, shape) for shape in mix]
    participants = [(g, r) for g, layout in enumerate(layouts) for r in range(len(layout))]
    models = [torch.randn(TOTAL, generator=torch.Generator().manual_seed(g)) for g in range(len(mix))]
    vectors = [local(models[g], layouts[g][r]) for g, r in participants]
    outs = [torch.full_like(v, float("nan")) for v in vectors]
    round_plan, group_id = plan(layouts, TOTAL), os.urandom(32)
    endpoints = [rank.endpoint for rank in ranks]
    rounds = [
        Round(vectors[i], outs[i], group_id=group_id, index=i, endpoints=endpoints, weight=1.0 + g, codec=codec,
              timeout=TIMEOUT, schedule=plan_schedule(round_plan, layouts, p, codec.part_numel),
              connect=ranks[i].tunnel.connect)  # fmt: skip
        for i, (p, (g, _)) in enumerate(zip(participants, participants))
    ]
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            rounds[i].run()
        except RoundFailed as e:
            errors.append(str(e))

    for rank, round_ in zip(ranks, rounds):
        rank.listener.register(round_)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(rounds))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=4 * TIMEOUT)
    for rank, round_ in zip(ranks, rounds):
        rank.listener.unregister(round_)
    # on failure, each reducer's side too: whom it left out and why (a timeout, a rejection), or nobody (the bytes)
    left_out = {r.index: dict(r._banned) for r in rounds if r._banned}
    assert not any(t.is_alive() for t in threads) and errors == [], (errors, left_out)
    # each group's ranks' exchanged values, in canonical order: the same in both groups, to the bit
    results = []
    for g, layout in enumerate(layouts):
        canonical = torch.full((TOTAL,), float("nan"))
        for i, (h, r) in enumerate(participants):
            if h == g:
                for p in layout[r].exchanged:
                    canonical[p.start : p.stop] = outs[i][p.local : p.local + p.numel]
        results.append(canonical)
    assert not results[0].isnan().any() and torch.equal(results[0], results[1])
    expected = (models[0].double() + 2 * models[1].double()) / 3
    if compression in ("none", "fp16"):
        assert float((results[0].double() - expected).abs().max()) <= (1e-6 if compression == "none" else 2e-3)
    else:  # as over TCP (test_tcp's bounds)
        bound = {"int8": 0.05, "int4": 0.15}[compression]
        assert float((results[0].double() - expected).norm() / expected.norm()) <= bound
    assert all(r.bytes_sent > 0 and r.bytes_received > 0 for r in rounds)


def test_a_state_downloads_across_shapes_over_libp2p(ranks: list[Rank]):
    """Ranks 1 and 2 serve a 2-rank FULL_SHARD group's state; rank 0, a 1-rank group, downloads all of it."""
    source = group_layout(SHAPES, Shape("FULL_SHARD", 2))
    outer, momentum = torch.randn(TOTAL), torch.randn(TOTAL)
    meta = {"outer_step": 4, "step": 16, "digest": "d"}
    for rank, layout in zip(ranks[1:], source):
        state = (meta, [local(outer, layout), local(momentum, layout)])
        rank.listener.serve(transfer.MAGIC, transfer.StateService(layout, lambda s=state: s, timeout=10))
    me = group_layout(SHAPES, Shape("FULL_SHARD", 1))[0]
    endpoints = [rank.endpoint for rank in ranks[1:]]
    got = transfer.download(me, source, endpoints, timeout=10, connect=ranks[0].tunnel.connect)
    assert got is not None and got[0] == meta
    assert torch.equal(got[1][0], outer) and torch.equal(got[1][1], momentum)


def test_an_unreachable_peer_is_a_connection_error_in_bounded_time(ranks: list[Rank]):
    stranger = start_dht(initial_peers=visible_maddrs(ranks[0].dht), host_maddrs=LOCAL, announce_maddrs=[])
    try:
        # a live peer without the protocol (a DHT with no tunnel), then an id nobody has
        for peer in (stranger.peer_id.to_base58(), "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"):
            started = time.monotonic()
            with pytest.raises(ConnectionError):
                ranks[0].tunnel.connect(((peer,), 0), timeout=3)
            assert time.monotonic() - started < 10
    finally:
        assert shutdown_dht(stranger) == []


def test_a_new_tunnel_on_the_same_peer_takes_the_streams_once_the_last_closed(ranks: list[Rank]):
    """One DHT peer, tunnels one after another (the bench's cases do that): closing one gives the daemon's handler
    back; a second one open at the same time is refused."""
    with pytest.raises(Exception, match="already set"):
        Tunnel(ranks[2].dht, ranks[2].listener)
    ranks[2].tunnel.close()
    ranks[2].tunnel = Tunnel(ranks[2].dht, ranks[2].listener)
    test_a_state_downloads_across_shapes_over_libp2p(ranks)

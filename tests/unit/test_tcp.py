"""The TCP transport (a butterfly all-reduce) on its own: peers as threads of this process, real sockets on loopback."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import threading
import time

import pytest
import torch

from diloco.swarm.rounds import hello as hellos
from diloco.swarm.rounds import tcp
from diloco.swarm.rounds.codecs import WIRE_FORMATS
from diloco.swarm.rounds.frames import LENGTH, Frames, bytes_of, seal_keys
from diloco.swarm.rounds.layout import (
    Shape,
    flat_parts,
    group_layout,
    plan,
    plan_schedule,
)
from diloco.swarm.rounds.listener import Listener, listen_socket
from diloco.swarm.rounds.screening import all_finite, screen
from diloco.swarm.rounds.tcp import FP16, RAW, Round, RoundFailed
from tests.support.tcp import canonical, randn, run_group
from tests.support.wiretap import Wiretap

torch.set_num_threads(1)


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("numel", [1, 3, 1000, 600_001])
def test_every_peer_ends_with_the_same_mean(k: int, numel: int):
    vectors = [randn(numel, seed) for seed in range(k)]
    originals = [v.clone() for v in vectors]
    outs, errors, rounds, _ = run_group(vectors)
    assert errors == [None] * k
    assert all(torch.equal(outs[0], out) for out in outs)  # bit-identical
    mean = torch.stack([v.double() for v in originals]).mean(0)
    assert float((outs[0].double() - mean).abs().max()) <= 1e-6
    assert all(torch.equal(v, o) for v, o in zip(vectors, originals))  # inputs are only read
    assert all(r.bytes_sent > 0 and r.bytes_received > 0 and r.rejected == 0 for r in rounds)
    if k == 2:  # a peer sends its part of the other span and the averages of its own: the vector, plus framing
        assert all(4 * numel <= r.bytes_sent <= 4 * numel + 1024 for r in rounds), [r.bytes_sent for r in rounds]


def test_two_peers_get_exactly_the_fp32_mean_and_weights_count():
    a, b = randn(300_000, 1), randn(300_000, 2)
    outs, errors, _, _ = run_group([a, b])
    assert errors == [None, None] and torch.equal(outs[0], (a + b) / 2)
    outs, errors, _, _ = run_group([a, b], weights=[1.0, 0.0])  # weight 0: takes the others' mean, adds nothing
    assert errors == [None, None] and torch.equal(outs[0], a) and torch.equal(outs[1], a)
    outs, errors, _, _ = run_group([a, b], weights=[3.0, 1.0])
    assert errors == [None, None] and torch.allclose(outs[0], 0.75 * a + 0.25 * b, atol=1e-6)


@pytest.mark.parametrize("codec", [RAW, FP16], ids=["fp32", "fp16"])
def test_a_round_where_nobody_has_weight_fails_everywhere_instead_of_returning_nan(codec: tcp.Codec):
    """Two groups that both just loaded the swarm's state join a round with weight 0 each: the mean is 0/0. Applied,
    that NaN would end both groups' training; the round fails at every peer instead (the inner steps carry over)."""
    a, b = randn(300_000, 1), randn(300_000, 2)
    outs, errors, _, _ = run_group([a, b], codec=codec, weights=[0.0, 0.0])
    assert all(error is not None and "NaN/Inf" in error for error in errors), errors


def test_fp16_sends_half_the_bytes_and_all_peers_hold_the_same_rounding():
    vectors = [randn(500_000, seed) for seed in range(3)]
    raw = run_group([v.clone() for v in vectors])
    half = run_group([v.clone() for v in vectors], codec=FP16)
    assert half[1] == [None] * 3
    assert all(torch.equal(half[0][0], out) for out in half[0])
    assert float((half[0][0] - raw[0][0]).abs().max()) <= 5e-3
    assert 0.45 < half[2][0].bytes_sent / raw[2][0].bytes_sent < 0.55


def test_layout_gives_every_reducer_a_part_when_it_can():
    assert flat_parts(10, 4, 2**18) == (3, [range(0, 1), range(1, 2), range(2, 3), range(3, 4)])
    assert flat_parts(2, 4, 2**18) == (1, [range(0, 0), range(0, 1), range(1, 1), range(1, 2)])
    size, spans = flat_parts(1_200_000, 3, 2**18)
    assert size == 2**18 and [len(s) for s in spans] == [1, 2, 2] and spans[-1][-1] * size < 1_200_000


MODEL_SHAPES = [(300, 40), (40,), (123, 40), (7,), (5, 3, 2)]
MODEL_NUMEL = sum(math.prod(shape) for shape in MODEL_SHAPES)


@pytest.mark.parametrize("codec", [RAW, FP16, WIRE_FORMATS["int8"].tcp, WIRE_FORMATS["int4"].tcp], ids=lambda c: c.name)
@pytest.mark.parametrize(
    "mix",
    [[Shape("FULL_SHARD", 1), Shape("FULL_SHARD", 2)], [Shape("NO_SHARD", 2), Shape("FULL_SHARD", 2)],
     [Shape("FULL_SHARD", 3), Shape("DDP", 1), Shape("HYBRID_SHARD", 4, nodes=2)]],
    ids=["1+2", "noshard2+fsdp2", "3+1+hybrid4"],
)  # fmt: skip


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in-place"])
def test_groups_of_different_shapes_average_bit_identically(mix: list[Shape], codec: tcp.Codec, in_place: bool):
    """Also in place, as the trainer runs it: a part's average arrives only after the part was sent."""
    codec = dataclasses.replace(codec, part_numel=1000)  # many parts, cut across the shards
    layouts = [group_layout(MODEL_SHAPES, shape) for shape in mix]
    round_plan = plan(layouts, MODEL_NUMEL)
    participants = [(g, r) for g, layout in enumerate(layouts) for r in range(len(layout))]
    models = [randn(MODEL_NUMEL, seed) for seed in range(len(mix))]
    vectors = [torch.cat([models[g][p.start : p.stop] for p in layouts[g][r].held]) for g, r in participants]
    group_weights = [1.0 + g for g in range(len(mix))]
    schedules = [plan_schedule(round_plan, layouts, p, codec.part_numel) for p in participants]
    weights = [group_weights[g] for g, _ in participants]
    outs, errors, rounds, _ = run_group(vectors, codec, weights, schedules=schedules, in_place=in_place)
    assert errors == [None] * len(participants)
    results = [canonical([outs[i] for i, (h, _) in enumerate(participants) if h == g], layout, MODEL_NUMEL)
               for g, layout in enumerate(layouts)]  # fmt: skip
    assert not results[0].isnan().any()
    assert all(torch.equal(results[0], result) for result in results)  # bit-identical in every group
    expected = sum(w * m.double() for w, m in zip(group_weights, models)) / sum(group_weights)
    if codec.name in ("int8", "int4"):  # judged as test_swarm judges int8 (0.02 there); int4 measured 0.1
        bound = {"int8": 0.05, "int4": 0.15}[codec.name]
        assert float((results[0].double() - expected).norm() / expected.norm()) <= bound
    else:
        assert float((results[0].double() - expected).abs().max()) <= (1e-6 if codec.raw else 2e-3)
    # a rank sends at most its own shard plus the averages of what it reduces, each once per other contributor
    for (g, r), round_ in zip(participants, rounds):
        reduced = sum(s.numel for s in round_plan.reduced_by((g, r)))
        bound = 4 * (layouts[g][r].exchanged_numel + reduced * (len(mix) - 1)) + 64 * len(round_plan.spans) + 4096
        assert round_.bytes_sent <= bound, (g, r, round_.bytes_sent, bound)


def test_peers_with_different_schedules_refuse_each_other():
    layouts = [group_layout(MODEL_SHAPES, Shape("FULL_SHARD", 1)) for _ in range(2)]
    plan_of_two = plan(layouts, MODEL_NUMEL)
    # the same plan in parts of 1000 values against a flat schedule in parts of 2**18: the bytes would not line up
    schedules = [plan_schedule(plan_of_two, layouts, (0, 0), 1000), None]
    vectors = [randn(MODEL_NUMEL, 0), randn(MODEL_NUMEL, 1)]
    _, errors, _, _ = run_group(vectors, RAW, timeout=1.0, schedules=schedules)
    assert all(error is not None for error in errors), errors


def test_screen_rejects_non_finite_huge_and_badly_weighted_contributions():
    assert screen({0: 1.0, 1: 2.0, 2: 150.0}, {0: 1, 1: 1, 2: 1}) == {}
    assert list(screen({0: 1.0, 1: 2.0, 2: 201.0}, {0: 1, 1: 1, 2: 1})) == [2]  # lower median 2.0
    assert list(screen({0: 1.0, 1: 101.0}, {0: 1, 1: 1})) == [1]  # two peers: the larger one goes
    assert list(screen({0: 1.0, 1: float("nan"), 2: float("inf")}, {0: 1, 1: 1, 2: 1})) == [1, 2]
    assert list(screen({0: 1.0, 1: 1.0}, {0: 1, 1: -1.0})) == [1]
    assert screen({0: 0.0, 1: 5.0}, {0: 0, 1: 1}) == {}  # a joiner's zeros: no reference to judge by


@pytest.mark.parametrize("bad", ["nan", "huge"])
def test_a_bad_contribution_is_left_out_and_only_its_peer_fails(bad: str):
    vectors = [randn(400_000, seed) for seed in range(3)]
    vectors[2] = torch.full_like(vectors[2], float("nan")) if bad == "nan" else vectors[2] * 1e6
    outs, errors, rounds, _ = run_group(vectors)
    assert errors[:2] == [None, None] and errors[2] is not None and "own contribution" in errors[2]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], (vectors[0] + vectors[1]) / 2)
    assert sum(r.rejected for r in rounds) == 3  # each reducer left peer 2 out of its span once


def test_a_silent_groupmate_fails_the_round_in_bounded_time():
    """Peer 2 never shows up (it reduces a span nobody else can average): everyone else fails, no hang."""
    vectors = [randn(100_000, seed) for seed in range(3)]
    _, errors, _, seconds = run_group(vectors, timeout=1.0, members=[0, 1])
    assert all(error is not None and "#2" in error for error in errors), errors
    assert seconds < 10, seconds


@pytest.mark.parametrize("busy", [False, True], ids=["left-out-and-idle", "in-a-round"])
def test_a_groupmate_left_out_by_matchmaking_is_learnt_of_soon(busy: bool):
    """A matchmaking split: peer 1 averaged alone and trains on, and never registers the round peer 0 started with
    it. While peer 1 is in no round its listener drops peer 0's connection after `idle_wait`, so peer 0's round
    fails after its own timeout (waiting for peer 1's parts) instead of its handshake's; a peer that is in a round
    (about to register it) is waited for."""
    timeout = 2.5  # peer 0 waits that long for peer 1's parts, and twice that for its handshake's answer
    listening = [listen_socket("127.0.0.1", 0) for _ in range(2)]
    listeners = [Listener(sock, timeout, registration_timeout=60, idle_wait=0.2).start() for sock in listening]
    endpoints = [(["127.0.0.1"], sock.getsockname()[1]) for sock in listening]
    vector = randn(1000, 0)
    round_ = Round(vector, torch.empty_like(vector), group_id=os.urandom(32), index=0, endpoints=endpoints,
                   weight=1.0, codec=RAW, timeout=timeout)  # fmt: skip
    listeners[0].register(round_)
    started = time.monotonic()
    try:
        if busy:
            with listeners[1].in_round(), pytest.raises(RoundFailed):
                round_.run()
        else:
            with pytest.raises(RoundFailed):
                round_.run()
    finally:
        for listener in listeners:
            listener.close()
    seconds = time.monotonic() - started
    if busy:
        assert seconds >= 2 * timeout - 0.1, seconds  # held until the handshake timed out
    else:
        assert seconds < 2 * timeout - 0.5, seconds  # about `timeout`


def test_a_sender_that_dies_mid_stream_is_left_out():
    """A groupmate connects, sends one part of reducer 0's span and vanishes: reducer 0 averages the rest without
    it, and the round fails only where averages are missing."""
    vectors = [randn(9 * 2**18, seed) for seed in range(3)]  # three parts per span
    k = 3
    listeners = [Listener(listen_socket("127.0.0.1", 0), 2.0).start() for _ in range(k)]
    endpoints = [(["127.0.0.1"], listener._sock.getsockname()[1]) for listener in listeners]
    group_id = os.urandom(32)
    outs = [torch.empty_like(v) for v in vectors]
    rounds = [Round(v, o, group_id=group_id, index=i, endpoints=endpoints, weight=1.0, codec=RAW, timeout=2.0)
              for i, (v, o) in enumerate(zip(vectors, outs))]  # fmt: skip
    for listener, round_ in zip(listeners, rounds):
        listener.register(round_)
    # peer 2 "dies": only its connection to reducer 0 exists, and it stops after the first part
    doomed = rounds[2]._connect(0)
    lo, hi = rounds[2]._bounds(rounds[2].schedule.parts[0][0])
    rounds[2]._send(doomed, RAW.encode(vectors[2][lo:hi]))
    errors: list[str | None] = [None, None]

    def member(i: int) -> None:
        try:
            rounds[i].run()
        except RoundFailed as e:
            errors[i] = str(e)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    doomed.close()
    for thread in threads:
        thread.join(timeout=30)
    for listener in listeners:
        listener.close()
    assert all(error is not None and "#2" in error for error in errors), errors  # peer 2's span is missing
    assert 2 in rounds[0]._banned  # reducer 0 dropped it


class LateClose(socket.socket):
    """A sender's socket whose end stays open ``delay`` s after its round is done with it."""

    delay = 1.0
    closed_at: float | None = None

    def shutdown(self, how: int) -> None:
        if self.closed_at is None:
            time.sleep(self.delay)
            self.closed_at = time.monotonic()
        super().shutdown(how)


def test_a_reducer_closes_a_senders_connection_only_after_the_sender_did():
    """The side that received last closes first: over p2pd a reducer that closed right after its last average could
    have its daemon reset the stream, losing averages the sender's daemon had not passed on (``tcp.await_close``)."""
    vectors = [randn(300_000, seed) for seed in range(2)]
    listeners = [Listener(listen_socket("127.0.0.1", 0), 5.0).start() for _ in range(2)]
    endpoints = [(["127.0.0.1"], listener._sock.getsockname()[1]) for listener in listeners]
    late: list[LateClose] = []

    def late_connect(endpoint, timeout, handshake):
        late.append(LateClose(fileno=tcp.connect(endpoint, timeout).detach()))
        return handshake(late[-1])

    group_id = os.urandom(32)
    outs = [torch.empty_like(v) for v in vectors]
    rounds = [Round(v, o, group_id=group_id, index=i, endpoints=endpoints, weight=1.0, codec=RAW, timeout=5.0,
                    connect=late_connect if i == 1 else tcp.connect)
              for i, (v, o) in enumerate(zip(vectors, outs))]  # fmt: skip
    for listener, round_ in zip(listeners, rounds):
        listener.register(round_)
    ended: list[float | None] = [None, None]

    def member(i: int) -> None:
        rounds[i].run()
        ended[i] = time.monotonic()

    threads = [threading.Thread(target=member, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for listener in listeners:
        listener.close()
    assert None not in ended and torch.equal(outs[0], outs[1])  # both rounds completed
    assert len(late) == 1 and late[0].closed_at is not None
    assert ended[0] >= late[0].closed_at  # reducer 0 waited for peer 1 to close


@pytest.mark.parametrize("frame", ["length 2**40", "short part", "nothing (slowloris)"])
def test_a_hostile_groupmates_frames_are_refused_and_the_reducer_goes_on(frame: str):
    """Groupmate 2 passes the handshake with reducer 0, then sends a length header claiming 2**40 bytes, a part
    shorter than the schedule's, or nothing at all: reducer 0 drops it (at once, or after its timeout), never
    allocates what the header claims, and averages its span from the other two."""
    vectors = [randn(3 * 2**18, seed) for seed in range(3)]
    listeners = [Listener(listen_socket("127.0.0.1", 0), 2.0).start() for _ in range(3)]
    endpoints = [(["127.0.0.1"], listener._sock.getsockname()[1]) for listener in listeners]
    group_id = os.urandom(32)
    outs = [torch.full_like(v, float("nan")) for v in vectors]
    rounds = [Round(v, o, group_id=group_id, index=i, endpoints=endpoints, weight=1.0, codec=RAW, timeout=2.0)
              for i, (v, o) in enumerate(zip(vectors, outs))]  # fmt: skip
    for listener, round_ in zip(listeners[:2], rounds[:2]):
        listener.register(round_)
    hostile = rounds[2]._connect(0)
    if frame == "length 2**40":
        hostile.sendall(LENGTH.pack(2**40))
    elif frame == "short part":
        hostile.sendall(LENGTH.pack(12) + b"\0" * 12)
    threads = [threading.Thread(target=lambda r=r: _raises(r.run)) for r in rounds[:2]]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    hostile.close()
    for listener in listeners:
        listener.close()
    assert time.monotonic() - started < 15
    assert 2 in rounds[0]._banned, rounds[0]._banned
    assert rounds[0].dropped == 1 and rounds[0].rejected == 0  # counted (a row's `dropped`), not as a bad value
    lo, hi = rounds[0]._bounds(rounds[0].schedule.parts[0][0])  # reducer 0's first part, averaged without peer 2
    assert torch.equal(outs[1][lo:hi], (vectors[0][lo:hi] + vectors[1][lo:hi]) / 2)


@pytest.mark.parametrize("sealed", [False, True], ids=["open", "sealed"])
def test_a_sealed_round_hides_its_values_from_a_machine_on_the_path(sealed: bool):
    """Every byte between three peers passes a wiretap. Open, the values and their average cross it as they are;
    sealed (a keyed swarm), no 32 bytes of them do, and the peers still end with the very same mean."""
    vectors = [randn(300_000, seed) for seed in range(3)]
    tap = Wiretap()
    try:
        outs, errors, rounds, _ = run_group([v.clone() for v in vectors], sealed=sealed, relay=tap.relay)
    finally:
        tap.close()
    assert errors == [None] * 3 and all(torch.equal(outs[0], out) for out in outs)
    assert float((outs[0].double() - torch.stack(vectors).double().mean(0)).abs().max()) <= 1e-6
    seen = bytes(tap.seen)
    assert len(seen) >= 4 * 300_000 * 2  # (each peer sends about two thirds of its vector and gets as much back)
    # 32 bytes at places of every reducer's span: each crosses the wire, but from the peer that reduces it
    places = [1000, 150_000, 290_000]
    crossed = [any(bytes(bytes_of(v[at : at + 8])) in seen for at in places) for v in vectors + outs[:1]]
    assert crossed == [not sealed] * 4
    if sealed:  # 16 bytes of tag per message, 16 of nonce per connection
        assert all(r.bytes_sent > 4 * 300_000 * 2 / 3 for r in rounds)


@pytest.mark.parametrize("sealed", [False, True], ids=["open", "sealed"])
def test_a_byte_altered_on_the_path_fails_a_sealed_round_and_slips_through_an_open_one(sealed: bool):
    """The wiretap flips one bit of a part in every sender -> reducer connection. Sealed, every reducer drops the
    senders whose part fails its seal and no peer ends with the whole average; open, the round ends "ok" with a
    wrong value: the reason a keyed swarm seals."""
    vectors = [randn(2**18, seed) for seed in range(2)]
    tap = Wiretap(flip_at=tcp.HELLO.size + tcp.MAC_SIZE + 8 + 4000)  # past the hello and a length header
    try:
        outs, errors, rounds, _ = run_group([v.clone() for v in vectors], sealed=sealed, relay=tap.relay)
    finally:
        tap.close()
    mean = (vectors[0] + vectors[1]) / 2
    if sealed:
        assert all(error is not None for error in errors), errors
        assert sum(r.dropped for r in rounds) >= 1
        assert any("seal" in reason for r in rounds for reason in r._banned.values()), [r._banned for r in rounds]
    else:
        assert errors == [None, None] and not torch.equal(outs[0], mean)


def replay_hello(port: int, recorded: Round, tag: bytes, wait_s: float) -> bytes:
    """Send peer 0's hello to peer 1 of `recorded` (MAC under its group id) with `tag`; the first byte answered
    within `wait_s` (b"": the connection was closed unanswered)."""
    hello = hellos.pack(hellos.new_hello(tag, 0, 1, 2, recorded.digest, "none", 1.0), recorded.group_id, None)
    with socket.create_connection(("127.0.0.1", port)) as replay:
        replay.sendall(hello)
        replay.settimeout(wait_s)
        return replay.recv(1)


def test_a_hello_replayed_from_an_earlier_round_is_refused():
    """A groupmate's hello of round A, recorded and replayed to the same peer during round B (another group id):
    it names a round that is not there, or carries the MAC of another key, and is dropped unanswered."""
    listener = Listener(listen_socket("127.0.0.1", 0), 2.0, registration_timeout=0.5).start()
    endpoints = [(["127.0.0.1"], 1), (["127.0.0.1"], listener._sock.getsockname()[1])]
    vector = randn(1000, 0)
    old, new = (Round(vector, vector.clone(), group_id=os.urandom(32), index=1, endpoints=endpoints, weight=1.0,
                      codec=RAW, timeout=2.0) for _ in range(2))  # fmt: skip
    listener.register(new)
    try:
        for tag in (old.tag, new.tag):  # as recorded; and with the tag patched to the new round's
            assert replay_hello(endpoints[1][1], old, tag, wait_s=5) == b""  # dropped without an answer
        assert not new._attached and listener.refused == 2  # counted (summary.json's `refused_connections`)
    finally:
        listener.close()


def test_a_hello_for_a_round_that_ended_here_is_dropped_at_once():
    """A replayed (or late) hello for a round this rank already left is dropped at once, even while the rank is in
    another round, when a hello for a round not registered yet waits the registration timeout: a replay costs the
    listener no thread for that long."""
    listener = Listener(listen_socket("127.0.0.1", 0), 2.0, registration_timeout=30.0).start()
    endpoints = [(["127.0.0.1"], 1), (["127.0.0.1"], listener._sock.getsockname()[1])]
    vector = randn(1000, 0)
    ended = Round(vector, vector.clone(), group_id=os.urandom(32), index=1, endpoints=endpoints, weight=1.0,
                  codec=RAW, timeout=2.0)  # fmt: skip
    listener.register(ended)
    listener.unregister(ended)
    try:
        with listener.in_round():
            started = time.monotonic()
            assert replay_hello(endpoints[1][1], ended, ended.tag, wait_s=10) == b""  # dropped without an answer
            assert time.monotonic() - started < 5.0 and listener.refused == 1
    finally:
        listener.close()


def test_strangers_and_wrong_hosts_are_refused_and_the_round_goes_on():
    """A connection with a wrong MAC is dropped; an endpoint whose first host answers on that port but is not the
    peer (say, another machine's loopback) fails the handshake there and is reached through its next host."""
    vectors = [randn(50_000, seed) for seed in range(2)]
    listeners = [Listener(listen_socket("127.0.0.1", 0), 5.0).start() for _ in range(2)]
    ports = [listener._sock.getsockname()[1] for listener in listeners]
    decoy = Listener(listen_socket("127.0.0.2", ports[1]), 1.0).start()  # same port, another address, no round
    group_id = os.urandom(32)
    outs = [torch.empty_like(v) for v in vectors]
    endpoints = [(["127.0.0.1"], ports[0]), (["127.0.0.2", "127.0.0.1"], ports[1])]
    rounds = [Round(v, o, group_id=group_id, index=i, endpoints=endpoints, weight=1.0, codec=RAW, timeout=5.0)
              for i, (v, o) in enumerate(zip(vectors, outs))]  # fmt: skip
    for listener, round_ in zip(listeners, rounds):
        listener.register(round_)
    stranger = socket.create_connection(("127.0.0.1", ports[1]))
    hello = hellos.pack(hellos.new_hello(rounds[1].tag, 0, 1, 2, rounds[1].digest, "none", 1.0), os.urandom(32), None)
    stranger.sendall(hello)  # the MAC of another key
    stranger.settimeout(5)
    assert stranger.recv(1) == b""  # dropped without an answer
    stranger.close()
    failures: list[BaseException] = []
    threads = [threading.Thread(target=lambda r=r: failures.extend(_raises(r.run))) for r in rounds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for listener in [decoy, *listeners]:
        listener.close()
    assert failures == [] and torch.equal(outs[0], outs[1]) and torch.equal(outs[0], (vectors[0] + vectors[1]) / 2)


def test_abort_ends_a_round_at_once():
    """An aborted round (hivemind's round timeout) stops its threads and raises, even while peers stay silent."""
    vectors = [randn(100_000, seed) for seed in range(2)]
    listener = Listener(listen_socket("127.0.0.1", 0), 30.0).start()
    endpoints = [(["127.0.0.1"], listener._sock.getsockname()[1]), (["127.0.0.1"], 9)]  # peer 1 never answers
    round_ = Round(vectors[0], torch.empty(100_000), group_id=os.urandom(32), index=0, endpoints=endpoints,
                   weight=1.0, codec=RAW, timeout=30.0)  # fmt: skip
    listener.register(round_)
    failure: list[BaseException] = []
    thread = threading.Thread(target=lambda: failure.extend(_raises(round_.run)))
    thread.start()
    time.sleep(0.5)
    started = time.monotonic()
    round_.abort()
    thread.join(timeout=10)
    listener.close()
    assert not thread.is_alive() and time.monotonic() - started < 5
    assert len(failure) == 1 and isinstance(failure[0], RoundFailed)


def _raises(call) -> list[BaseException]:
    try:
        call()
    except BaseException as e:  # noqa: BLE001 (the test inspects it)
        return [e]
    return []


def test_all_finite_agrees_with_isfinite():
    """The check of received averages (torch.aminmax) against torch.isfinite, value by value."""
    values = torch.randn(10_000)
    assert all_finite(values) and all_finite(torch.empty(0))
    assert all_finite(torch.tensor([3.4e38, -3.4e38]))  # finite extremes: max and min stay finite
    for bad in (float("nan"), float("inf"), float("-inf")):
        for index in (0, 5000, 9999):
            spoiled = values.clone()
            spoiled[index] = bad
            assert not all_finite(spoiled) and not bool(torch.isfinite(spoiled).all()), (bad, index)


def test_a_local_failure_fails_the_round_instead_of_blaming_the_sender(monkeypatch):
    """A computation of this process that fails in a reader thread (seen on a GPU box: torch's thread pool after
    fork) must fail the round, not leave the groupmate out of an average that then passes for ok."""
    failed = threading.Event()
    real_norm = tcp.part_norm

    def flaky_norm(part: torch.Tensor) -> float:
        if threading.current_thread().name == "butterfly-_read_parts" and not failed.is_set():
            failed.set()
            raise RuntimeError("pool INTERNAL ASSERT FAILED: Invalid thread pool!")
        return real_norm(part)

    monkeypatch.setattr(tcp, "part_norm", flaky_norm)
    outs, errors, rounds, _ = run_group([randn(600_000, seed) for seed in range(2)], timeout=2.0)
    assert failed.is_set()
    assert all(error is not None for error in errors), errors  # nobody reports ok with half an average
    failing = [r for r, error in zip(rounds, errors) if "Invalid thread pool" in error]
    assert len(failing) == 1 and failing[0]._banned == {}, errors  # it did not blame its groupmate


def test_a_sealed_message_replayed_or_sealed_under_another_key_fails_its_seal():
    """Over a socket pair: sealed messages arrive in order; the same sealed bytes sent again (a replay within the
    connection) fail, as does a message sealed under another key, and a header claiming more than asked."""
    a, b = socket.socketpair()
    try:
        keys = seal_keys(os.urandom(32), b"hello")
        sender, receiver = Frames(a, send_key=keys[0]), Frames(b, receive_key=keys[0])
        assert sender.send(b"first") == 8 + 5 + 16 and bytes(receiver.receive(5)) == b"first"
        recorded = LENGTH.pack(5 + 16) + bytes(_seal_of(keys[0], b"again", 1))
        a.sendall(recorded)
        assert bytes(receiver.receive(5)) == b"again"
        a.sendall(recorded)  # the same bytes once more: its nonce (count 1) is behind the receiver's (2)
        with pytest.raises(ValueError, match="fails its seal"):
            receiver.receive(5)
        other = Frames(a, send_key=seal_keys(os.urandom(32), b"hello")[0])
        other.send(b"stranger")
        with pytest.raises(ValueError, match="fails its seal"):
            Frames(b, receive_key=keys[0]).receive(8)
        a.sendall(LENGTH.pack(2**40))
        with pytest.raises(ValueError, match="at most 8 expected"):
            receiver.receive(8)
    finally:
        a.close()
        b.close()


def _seal_of(key: bytes, data: bytes, count: int) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key).encrypt(count.to_bytes(12, "big"), data, None)

"""Each member of a round speaks for itself: signed hellos, weights from the announcements (capped), fresh keys per
connection, and a deadline no peer can stretch. Peers are threads of this process, on real sockets over loopback."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from diloco.swarm.rounds import hello as hellos
from diloco.swarm.rounds.frames import LENGTH, seal_keys
from diloco.swarm.rounds.group_round import Member, members_digest, roster, same_model
from diloco.swarm.rounds.layout import Shape
from diloco.swarm.rounds.listener import Listener, listen_socket
from diloco.swarm.rounds.screening import capped_weights
from diloco.swarm.rounds.tcp import RAW, Round, RoundFailed
from tests.support.tcp import randn

torch.set_num_threads(1)


class Group:
    """k one-rank groups, each with its listener and signing key, and the members they announce."""

    def __init__(self, k: int, weights: list[float] | None = None) -> None:
        self.listeners = [Listener(listen_socket("127.0.0.1", 0), 5.0).start() for _ in range(k)]
        self.ports = [listener._sock.getsockname()[1] for listener in self.listeners]
        self.endpoints = [(["127.0.0.1"], port) for port in self.ports]
        self.signers = [Ed25519PrivateKey.generate() for _ in range(k)]
        self.group_id = os.urandom(32)
        weights = weights or [1.0] * k
        self.members = tuple(Member(Shape("FULL_SHARD", 1), ((("127.0.0.1",), port),), w, (hellos.public_bytes(s),))
                             for port, w, s in zip(self.ports, weights, self.signers))  # fmt: skip

    def rounds(self, vectors: list[torch.Tensor], views: list[tuple[Member, ...]] | None = None, **kw) -> list[Round]:
        """Every member's round, each over its own view of the announcements (default: all alike), registered."""
        views = views or [self.members] * len(vectors)
        rounds = [Round(v, torch.full_like(v, float("nan")), group_id=self.group_id, index=i, endpoints=self.endpoints,
                        roster=roster(view), signer=self.signers[i], codec=RAW, **{"timeout": 5.0} | kw)
                  for i, (v, view) in enumerate(zip(vectors, views))]  # fmt: skip
        for listener, round_ in zip(self.listeners, rounds):
            listener.register(round_)
        return rounds

    def close(self) -> None:
        for listener in self.listeners:
            listener.close()


def run_all(rounds: list[Round]) -> list[str | None]:
    errors: list[str | None] = [None] * len(rounds)

    def one(i: int) -> None:
        try:
            rounds[i].run()
        except RoundFailed as e:
            errors[i] = str(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(rounds))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a round hangs"
    return errors


def forged_hello(group: Group, round_: Round, sender: int, reducer: int, signer: Ed25519PrivateKey,
                 weight: float | None = None, digest: bytes | None = None) -> bytes:  # fmt: skip
    """A hello of `sender` to `reducer` with the round's MAC, signed by `signer` (weight and digest: the roster's)."""
    weight = round_.roster.weights[sender] if weight is None else weight
    digest = round_.roster.digest if digest is None else digest
    fields = hellos.new_hello(round_.tag, sender, reducer, round_.k, round_.digest, "none", weight, digest)
    return hellos.pack(fields, group.group_id, signer)


def answered(port: int, hello: bytes) -> bytes:
    """Send `hello` to the listener at `port`; the first byte answered (b"": dropped unanswered)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(hello)
        sock.settimeout(5.0)
        return sock.recv(1)


def test_a_member_connecting_as_another_sender_index_is_refused_and_the_round_goes_on():
    """Member 2 knows the group id (every member does) and connects first to reducer 1 as sender 0, signing with its
    own key: refused. Sender 0's own connection is then taken, and every member ends with the plain mean (where the
    index was the wire's word, the impostor took sender 0's place and the reducer refused sender 0 as a duplicate)."""
    vectors = [randn(30_000, seed) for seed in range(3)]
    group = Group(3)
    try:
        rounds = group.rounds(vectors)
        assert answered(group.ports[1], forged_hello(group, rounds[1], 0, 1, group.signers[2])) == b""
        signed = forged_hello(group, rounds[1], 2, 1, group.signers[2])  # its own index, its signature altered
        assert answered(group.ports[1], signed[:-1] + bytes([signed[-1] ^ 1])) == b""  # (always another last byte)
        assert not rounds[1]._attached and group.listeners[1].refused == 2
        assert run_all(rounds) == [None] * 3
    finally:
        group.close()
    mean = (vectors[0] + vectors[1] + vectors[2]) / 3
    assert all(torch.allclose(r.out, mean, atol=1e-6) for r in rounds)


def test_a_weight_of_1e30_counts_as_16_median_groups_and_a_hello_claiming_another_weight_is_refused():
    vectors = [randn(30_000, seed) for seed in range(3)]
    group = Group(3, weights=[1.0, 1.0, 1e30])
    try:
        rounds = group.rounds(vectors)
        assert rounds[0].roster.weights == (1.0, 1.0, 16.0)
        # member 2 signs its own hello honestly but claims its announced weight, not the capped one
        assert answered(group.ports[0], forged_hello(group, rounds[0], 2, 0, group.signers[2], weight=1e30)) == b""
        assert not rounds[0]._attached
        assert run_all(rounds) == [None] * 3
    finally:
        group.close()
    expected = (vectors[0] + vectors[1] + 16 * vectors[2]) / 18
    assert all(torch.allclose(r.out, expected, atol=1e-5) for r in rounds)


def test_weights_are_capped_at_16_times_the_lower_median_of_the_positive_ones():
    assert capped_weights([1.0, 1.0, 1e30]) == [1.0, 1.0, 16.0]
    assert capped_weights([1.0, 1e30]) == [1.0, 16.0]  # two groups: against the smaller
    assert capped_weights([0.0, 1000.0, 3000.0]) == [0.0, 1000.0, 3000.0]  # a joiner's 0 lowers nobody's cap
    assert capped_weights([0.0, 0.0]) == [0.0, 0.0]
    tokens = [2.0e5, 5.0e5, 1.0e6, 2.5e6]  # honest groups of a token budget, 12.5x apart: untouched
    assert capped_weights(tokens) == tokens
    assert capped_weights([1.0, float("nan")])[1] != capped_weights([1.0, float("nan")])[1]  # left to the screen


def test_a_hello_naming_other_announcements_is_refused_and_a_round_of_two_views_fails():
    """A matchmaking leader that shows member 1 another weight for member 2 than the others see: member 1's hellos
    name another digest and are refused, and its reducer refuses the others'; nobody averages with mixed views."""
    vectors = [randn(30_000, seed) for seed in range(3)]
    group = Group(3)
    altered = (*group.members[:2], Member(**{**group.members[2].__dict__, "weight": 5.0}))
    assert members_digest(altered) != members_digest(group.members)
    try:
        rounds = group.rounds(vectors, views=[group.members, altered, group.members], timeout=1.0)
        other = members_digest(altered)
        assert answered(group.ports[0], forged_hello(group, rounds[0], 1, 0, group.signers[1], digest=other)) == b""
        assert not rounds[0]._attached
        errors = run_all(rounds)
    finally:
        group.close()
    assert errors[1] is not None and 1 in rounds[0]._banned and 1 in rounds[2]._banned
    assert all(1 not in r._attached for r in (rounds[0], rounds[2])) and not rounds[1]._attached


class FakeReducer:
    """A peer at reducer index 1 that acks every hello it gets (it knows the group id) with `ack` (None: the right
    one; else those bytes, recorded from an earlier connection) and then, if `trickle`, answers a length header
    and one byte every 0.2 s, forever."""

    def __init__(self, group_id: bytes, sealed: bool, ack: bytes | None = None, trickle: bool = False) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.group_id, self.sealed, self.ack, self.trickle = group_id, sealed, ack, trickle
        self.hellos: list[bytes] = []
        self.acks: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            conn, _ = self.server.accept()
            hello = bytearray(hellos.HELLO.size + hellos.MAC_SIZE)
            conn.recv_into(hello, len(hello), socket.MSG_WAITALL)
            self.hellos.append(bytes(hello))
            nonce = os.urandom(16) if self.sealed else b""
            ack = self.ack or nonce + hellos.mac(self.group_id, b"ack" + bytes(hello) + nonce)
            self.acks.append(ack)
            conn.sendall(ack)
            threading.Thread(target=lambda: [None for _ in iter(lambda: conn.recv(2**16), b"")], daemon=True).start()
            if self.trickle:
                conn.sendall(LENGTH.pack(2000))
                while True:
                    conn.sendall(b"\0")
                    time.sleep(0.2)
            time.sleep(30)
        except OSError:
            pass

    def close(self) -> None:
        self.server.close()


def sender_round(group_id: bytes, port: int, reducer_port: int, **kw) -> Round:
    vector = randn(1000, 0)
    endpoints = [(["127.0.0.1"], port), (["127.0.0.1"], reducer_port)]
    return Round(vector, vector.clone(), group_id=group_id, index=0, endpoints=endpoints, weight=1.0, codec=RAW, **kw)


def test_an_ack_recorded_on_an_earlier_connection_fails_when_a_group_id_repeats():
    """Two connections of one sender to one reducer under a repeated group id: the sender's hellos differ (its own
    nonce), so an ack recorded on the first and replayed on the second fails its MAC (accepting it, the sender would
    have derived the first connection's keys again, and sealed new values under reused AES-GCM nonces)."""
    group_id = os.urandom(32)
    listener = Listener(listen_socket("127.0.0.1", 0), 5.0).start()
    port = listener._sock.getsockname()[1]
    first = FakeReducer(group_id, sealed=True)
    try:
        round_ = sender_round(group_id, port, first.port, timeout=1.0, round_timeout=3.0, sealed=True)
        listener.register(round_)
        run_all([round_])
        listener.unregister(round_)
        assert round_._keys.get(1) is not None  # the handshake passed: keys of the first connection
        replayed = FakeReducer(group_id, sealed=True, ack=first.acks[0])
        again = sender_round(group_id, port, replayed.port, timeout=1.0, round_timeout=3.0, sealed=True)
        listener.register(again)
        errors = run_all([again])
    finally:
        listener.close()
        first.close()
    assert 1 not in again._keys and "wrong MAC" in (errors[0] or ""), errors
    old, new = first.hellos[0], replayed.hellos[0]
    assert old != new and old[:20] == new[:20]  # the same round's tag, another nonce
    nonce = first.acks[0][:16]  # even were the reducer's nonce repeated, the keys differ
    assert seal_keys(group_id, old + nonce) != seal_keys(group_id, new + nonce)


def test_a_peer_trickling_its_bytes_is_cut_at_the_rounds_deadline():
    """A reducer that sends its averages a byte every 0.2 s (well within the 1 s a single read may wait) held its
    sender's round for as long as it kept trickling; now every read ends by the round's deadline."""
    group_id = os.urandom(32)
    listener = Listener(listen_socket("127.0.0.1", 0), 5.0).start()
    reducer = FakeReducer(group_id, sealed=False, trickle=True)
    try:
        round_ = sender_round(group_id, listener._sock.getsockname()[1], reducer.port, timeout=1.0, round_timeout=3.0)
        listener.register(round_)
        started = time.monotonic()
        errors = run_all([round_])
        elapsed = time.monotonic() - started
    finally:
        listener.close()
        reducer.close()
    assert errors[0] is not None and "deadline" in errors[0], errors
    assert elapsed < 3.0 + 2.0, elapsed


def test_a_round_leaves_out_members_of_another_model_and_keeps_those_that_announce_none():
    assert same_model(["a", "b", "b", ""], "a") == [0, 3]  # strangers outnumbering this model send nobody out
    assert same_model(["a", "b"], "") == [0, 1]  # this group's model unknown: everyone
    assert same_model(["", ""], "a") == [0, 1]


@pytest.mark.parametrize("bad", [{"keys": ["00" * 31]}, {"keys": ["zz" * 32]}, {"keys": ["00" * 32] * 2},
                                 {"model": 5}, {"dialable": [True, False]}, {"dialable": [1]},
                                 {"dialable": "yes"}, {"relayed": [True, True]}, {"relayed": [1]},
                                 {"relayed": "yes"}, {"p2p": ["12D3KooW"] * 2}, {"p2p": ["not base58!"]},
                                 {"p2p": [5]}, {"p2p": ["1" * 65]}])  # fmt: skip
def test_an_announcement_with_malformed_keys_or_model_is_unreadable(bad: dict) -> None:
    from diloco.swarm.rounds.group_round import announced

    entry = {"shape": ["FULL_SHARD", 1, 1], "endpoints": [[["127.0.0.1"], 1]], "weight": 1.0, "keys": ["00" * 32]}
    assert announced(entry) is not None and announced(entry | bad) is None


def test_a_group_behind_a_router_announces_which_ranks_can_be_dialled_and_the_others_read_it():
    """A group whose ranks can all be dialled announces as earlier versions did (every one may reduce); one with a
    rank behind a router names it, and that changes the round's digest (two views of it refuse each other)."""
    from diloco.swarm.rounds.group_round import announced, members_digest

    entry = {"shape": ["FULL_SHARD", 2, 1], "endpoints": [[["10.0.0.1"], 1], [["10.0.0.1"], 2]], "weight": 1.0,
             "keys": ["00" * 32, "11" * 32]}  # fmt: skip
    everyone, behind = announced(entry), announced(entry | {"dialable": [True, False]})
    assert everyone.dialable == () and everyone.reducers() == (True, True)
    assert behind.reducers() == (True, False)
    assert members_digest([everyone]) != members_digest([behind])


def test_ranks_behind_a_relay_reduce_only_in_a_round_without_a_direct_rank():
    """Every byte to a relayed rank crosses the relay twice: a round with a rank dialled directly gives the spans to
    such ranks; a round of groups all behind routers gives them to the relayed ones. The flags are announced (and
    change the round's digest) only by a group with a relayed rank."""
    from diloco.swarm.rounds.group_round import announced, reducers

    def group(port: int, **flags: list[bool]) -> dict:
        return {"shape": ["FULL_SHARD", 2, 1], "endpoints": [[["10.0.0.1"], port], [["10.0.0.1"], port + 1]],
                "weight": 1.0, "keys": ["00" * 32, "11" * 32]} | flags  # fmt: skip

    public = announced(group(1))
    relayed = announced(group(3, relayed=[True, True]))
    half = announced(group(5, relayed=[False, True], dialable=[False, True]))  # rank 0 outbound only, rank 1 relayed
    assert relayed.relayed == (True, True) and relayed.reducers() == (True, True)
    assert reducers([public, relayed, half]) == [(True, True), (False, False), (False, False)]
    assert reducers([relayed, half]) == [(True, True), (False, True)]
    assert members_digest([relayed]) != members_digest([announced(group(3))])


def test_matchmaking_announces_every_ranks_key_and_the_model_and_leaves_out_keyless_and_other_model_groups():
    """What rank 0 announces carries its ranks' keys and the model; every member leaves out, alike, the groups that
    announce no key per rank (nobody could tell their connections from an impostor's) and those of another model."""
    from types import SimpleNamespace

    from diloco.swarm.rounds.group_round import GroupRounds
    from diloco.swarm.rounds.matchmaker import Match
    from diloco.swarm.rounds.report import RoundReport

    def other(port: int, **fields) -> dict:
        key = hellos.public_bytes(Ed25519PrivateKey.generate()).hex()
        return {"shape": ["FULL_SHARD", 1, 1], "endpoints": [[["127.0.0.1"], port]], "weight": 1.0, "keys": [key],
                "model": "m"} | fields  # fmt: skip

    others = [other(2), other(3, keys=None), other(4, model="x"), other(5, model=None), other(6, weight=1e30)]
    others = [{k: v for k, v in entry.items() if v is not None} for entry in others]
    seen: list[dict] = []

    def match(round_index: int, mine: dict, stop) -> tuple:
        seen.append(mine)
        return Match(b"g" * 20, [mine, *others], 0), RoundReport(1 + len(others), 0.0, 0, 0, True)

    rounds = GroupRounds(SimpleNamespace(match=match), rank=0, shape=Shape("FULL_SHARD", 1), model_shapes=[(4,)],
                         endpoints=[(("127.0.0.1",), 1)], broadcast=lambda o: o, listener=None, codec=RAW, timeout=1.0,
                         replicas=None, model="m")  # fmt: skip
    info, groups, ok, _ = rounds._match(3, 1.0, lambda: False, outer_step=2)
    assert seen[0]["keys"] == [hellos.public_bytes(rounds.signer).hex()] and seen[0]["model"] == "m"
    assert ok and info is not None and groups == 4 and rounds.malformed == 1
    assert [m.endpoints[0][1] for m in info.members] == [1, 2, 5, 6]
    assert roster(info.members).weights == (1.0, 1.0, 1.0, 16.0)


def test_a_rank_that_prefers_p2pd_is_dialled_at_its_peer_id_by_ranks_that_prefer_it_too():
    """A group that takes libp2p streams announces a peer id per rank ("" for a rank that does not); a rank that
    prefers p2pd dials those at their peer ids and everyone else over TCP; a rank that does not dials all over TCP."""
    from diloco.swarm.rounds.group_round import announced, paths

    def group(port: int, **flags: list) -> dict:
        return {"shape": ["FULL_SHARD", 2, 1], "endpoints": [[["10.0.0.1"], port], [["10.0.0.2"], port + 1]],
                "weight": 1.0, "keys": ["00" * 32, "11" * 32]} | flags  # fmt: skip

    streams = announced(group(1, p2p=["12D3KooWAbc", ""]))
    plain = announced(group(3))
    assert streams.p2p == ("12D3KooWAbc", "") and plain.p2p == ()
    assert members_digest([streams]) != members_digest([announced(group(1))])
    assert paths([streams, plain], streams=True) == (
        [(["12D3KooWAbc"], 0), (["10.0.0.2"], 2), (["10.0.0.1"], 3), (["10.0.0.2"], 4)], [True, False, False, False])
    assert paths([streams, plain], streams=False)[1] == [False] * 4

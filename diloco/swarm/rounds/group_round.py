"""One averaging round of worker groups of any shape, once matchmaking has told every rank who is in it.

Matchmaking happens once per group (its rank 0); what it learns, ``RoundInfo``, reaches the group's other ranks over
the group's own process group, with the round's per-step timeout (``diloco.swarm.rounds.deadline``: rank 0's, from
``--hv.averaging-timeout`` and, with auto, its recent rounds). Then every rank of every group runs its part of one
round (``diloco.swarm.rounds.tcp``, over TCP or, with ``--hv.transport p2pd``, over libp2p streams:
``diloco.swarm.rounds.tunnel``) over the round's plan (``diloco.swarm.rounds.layout``): it sends the canonical runs
it exchanges to their reducers, reduces its own spans, and receives the averages of what it sent. Replicas of a shard
(NO_SHARD, DDP, ZERO1, the nodes of HYBRID_SHARD) exchanged a slice each; they pass each other those slices over the
group's process group, so every rank ends with the average of everything it holds. No rank ever holds more than its
shard plus the spans it reduces.

The result is bit-identical in every group: each span's average is computed once, by its reducer, and the same
encoded bytes go to every group.

Each rank signs its connections with a key of its own (``diloco.swarm.rounds.hello``); its group announces every
rank's public key in matchmaking, with the group's weight, which every member caps alike
(``diloco.swarm.rounds.screening.capped_weights``): a reducer counts a sender with that weight, never one from the wire.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import get_args

import torch
import torch.distributed as dist
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from diloco.config import ShardingStrategy
from diloco.swarm.records.swarm_key import SwarmKey
from diloco.swarm.rounds import tcp
from diloco.swarm.rounds.aggregation import Aggregation
from diloco.swarm.rounds.deadline import Deadlines, round_bytes
from diloco.swarm.rounds.hello import KEY_SIZE, Roster, public_bytes
from diloco.swarm.rounds.layout import (
    Shape,
    Unreduced,
    group_layout,
    plan,
    plan_schedule,
    rank_layout,
    replica_bounds,
    replica_slice,
)
from diloco.swarm.rounds.listener import Listener, close_with_tunnel
from diloco.swarm.rounds.screening import capped_weights

log = logging.getLogger("diloco")

Endpoint = tuple[tuple[str, ...], int]  # a rank's listener: TCP ([hosts], port), or p2pd ((peer id,), 0)
STRATEGIES = set(get_args(ShardingStrategy))
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{0,64}")  # a libp2p peer id in base58, or "" (no streams)


@dataclass(frozen=True)
class Member:
    """A worker group in a round, as it announced itself in matchmaking: its shape, each rank's endpoint (in rank
    order), its weight in the average (before the round's cap), each rank's raw Ed25519 public key (in rank order;
    empty: none announced, and no round takes the group), its model's fingerprint ("": not announced) and which of
    its ranks can be dialled (in rank order; empty: every one, as groups announce when all can), and which of those
    are dialled through a relay (empty: none), and the libp2p peer id at which each rank takes streams as well
    (``--hv.transport p2pd``; "": it does not; empty: none does)."""

    shape: Shape
    endpoints: tuple[Endpoint, ...]
    weight: float
    keys: tuple[bytes, ...] = ()
    model: str = ""
    dialable: tuple[bool, ...] = ()
    relayed: tuple[bool, ...] = ()
    p2p: tuple[str, ...] = ()

    def reducers(self, direct_only: bool = False) -> tuple[bool, ...]:
        """Which ranks may reduce a span: those others can dial (`direct_only`: not through a relay)."""
        dialable = self.dialable or (True,) * self.shape.world_size
        if not direct_only or not self.relayed:
            return dialable
        return tuple(d and not r for d, r in zip(dialable, self.relayed))


def reducers(members: Sequence[Member]) -> list[tuple[bool, ...]]:
    """Per member, which ranks reduce a round's spans: those dialled directly when the round has any, since every
    byte to a relayed rank crosses its relay twice; otherwise those dialled through a relay (a swarm behind routers
    only)."""
    direct = [member.reducers(direct_only=True) for member in members]
    return direct if any(any(ranks) for ranks in direct) else [member.reducers() for member in members]


@dataclass(frozen=True)
class RoundInfo:
    """What matchmaking tells a group: the round's secret id, its groups in the order every group sees, which of
    them this group is, and whether the round's bytes are sealed (a keyed swarm: the id is then the round's secret
    under the swarm key)."""

    group_id: bytes
    members: tuple[Member, ...]
    me: int
    sealed: bool = False


@dataclass(frozen=True)
class Outcome:
    """How this rank's part of the round went: ok (its whole shard holds the average), and its bytes."""

    ok: bool
    bytes_sent: int
    bytes_received: int
    rejected: int
    error: str = ""
    dropped: int = 0  # groupmates this rank's reducer left out for their frames or their silence
    bytes_inbound: int = 0  # of its bytes, those over connections other ranks opened to it (it reduced for them)
    bytes_relayed: int = 0  # of its bytes, those that crossed a relay (to or from a rank dialled through one)
    transport: str = "tcp"  # what carried its connections: "tcp", "p2pd" (libp2p streams), or "tcp+p2pd"


def replica_ranks(shape: Shape) -> list[list[int]]:
    """The ranks of a group that hold the same shard, one list per shard index (rank order = replica order)."""
    ranks: list[list[int]] = [[] for _ in range(shape.grid()[0])]
    for rank in range(shape.world_size):
        ranks[shape.coordinates(rank)[0]].append(rank)
    return ranks


class Replicas:
    """Passes the slices replicas exchanged among them, over process groups made once for the group's shape (every
    rank of the group must build it, in the same order, as with any ``torch.distributed`` group)."""

    def __init__(self, shape: Shape, rank: int):
        self.shape, self.rank = shape, rank
        self._group = None
        self._members: list[int] = [rank]
        for ranks in replica_ranks(shape):
            if len(ranks) > 1:
                made = dist.new_group(ranks)  # collective over the whole group, even for ranks not in `ranks`
                if rank in ranks:
                    self._group, self._members = made, ranks

    def fill(self, buffer: torch.Tensor, slices: Sequence[tuple[int, int]] | None = None) -> None:
        """Complete `buffer` (this rank's local values) with the slices its replicas averaged (`slices`: each
        replica's, ``layout.replica_bounds``; default: equal ones)."""
        if self._group is None:
            return
        count = len(self._members)
        slices = slices or [replica_slice(buffer.numel(), i, count) for i in range(count)]
        width = max(end - begin for begin, end in slices)
        mine = slices[self._members.index(self.rank)]
        sent = torch.zeros(width, dtype=buffer.dtype)
        sent[: mine[1] - mine[0]] = buffer[mine[0] : mine[1]]
        gathered = [torch.empty(width, dtype=buffer.dtype) for _ in range(count)]
        dist.all_gather(gathered, sent, group=self._group)
        for (begin, end), values in zip(slices, gathered):
            buffer[begin:end] = values[: end - begin]


def members_digest(members: Sequence[Member]) -> bytes:
    """32 bytes that hash a round's members as announced (shapes, endpoints, weights, keys, models, in order): two
    participants that read different announcements hold different digests, and refuse each other's connections."""
    canonical = [[[m.shape.strategy, m.shape.world_size, m.shape.nodes], [[list(h), p] for h, p in m.endpoints],
                  repr(float(m.weight)), [k.hex() for k in m.keys], m.model]
                 + ([list(m.dialable)] if m.dialable else []) + ([["relayed", *m.relayed]] if m.relayed else [])
                 + ([["p2p", *m.p2p]] if m.p2p else []) for m in members]  # fmt: skip
    return hashlib.sha256(json.dumps(canonical, separators=(",", ":")).encode()).digest()


def roster(members: Sequence[Member]) -> Roster:
    """Every participant's key and capped weight (participants numbered group by group, rank by rank)."""
    if any(len(m.keys) != m.shape.world_size for m in members):
        raise ValueError("a member of the round announced no key for each of its ranks")
    weights = capped_weights([m.weight for m in members])
    return Roster(tuple(k for m in members for k in m.keys),
                  tuple(w for m, w in zip(members, weights) for _ in m.keys), members_digest(members))  # fmt: skip


def run_round(
    info: RoundInfo,
    rank: int,
    model_shapes: Sequence[Sequence[int]],
    vector: torch.Tensor,
    out: torch.Tensor,
    *,
    listener: Listener,
    codec: tcp.Codec,
    timeout: float,
    signer: Ed25519PrivateKey,
    connect: tcp.Connect = tcp.connect,
    aggregation: Aggregation = "mean",
    streams: bool = False,
) -> Outcome:
    """This rank's part of the round: `vector` is its local buffer (its shard of every parameter, concatenated in
    the model's order), and `out` receives the average of the runs it exchanges (the rest: ``Replicas.fill``); it may
    be `vector` itself. `signer`: this rank's key, the one its group announced for it. The round's connections end
    by ``tcp.ROUND_STEPS`` x `timeout` from now. With `streams` (this rank prefers libp2p streams and has a tunnel),
    a rank that takes streams too is dialled at its peer id (`connect` must take such endpoints,
    ``((peer id,), 0)``); every other pair goes over TCP.
    Never raises on network failures."""
    chunks = codec.chunks  # a sparse round's cuts fall on its chunks' boundaries
    layouts = [group_layout(model_shapes, member.shape, chunks) for member in info.members]
    total = sum(int(torch.Size(shape).numel()) for shape in model_shapes)
    if layouts[info.me][rank].local_numel != vector.numel():
        raise ValueError(f"rank {rank} holds {vector.numel()} values, its layout {layouts[info.me][rank].local_numel}")
    if chunks is not None and chunks.total != total:
        raise ValueError(f"a codec of a vector of {chunks.total} values for one of {total}")
    try:
        round_plan = plan(layouts, total, chunks, reducers(info.members))
    except Unreduced as e:  # every participant finds the same: the round fails alike everywhere, dialling no one
        log.warning("averaging: %s", e)
        return Outcome(False, 0, 0, 0, str(e))
    schedule = plan_schedule(round_plan, layouts, (info.me, rank), codec.part_numel, chunks)
    endpoints, over_streams = paths(info.members, streams)
    round_ = tcp.Round(
        vector, out, group_id=info.group_id, index=schedule.me, endpoints=endpoints, roster=roster(info.members),
        signer=signer, codec=codec, timeout=timeout, schedule=schedule, connect=connect, aggregation=aggregation,
        sealed=info.sealed,
    )  # fmt: skip
    listener.register(round_)
    try:
        round_.run()
        error = ""
    except tcp.RoundFailed as e:
        error = str(e)
        log.warning("averaging: this rank's part of the round failed: %s", error)
    finally:
        listener.unregister(round_)
    relayed = [r for member in info.members for r in (member.relayed or (False,) * member.shape.world_size)]
    through_relay = round_.bytes_inbound if relayed[schedule.me] else 0
    through_relay += sum(size for j, size in enumerate(round_.bytes_to) if relayed[j] and j != schedule.me)
    others = [used for j, used in enumerate(over_streams) if j != schedule.me]
    transport = "p2pd" if others and all(others) else "tcp+p2pd" if any(others) else "tcp"
    return Outcome(not error, round_.bytes_sent, round_.bytes_received, round_.rejected, error, round_.dropped,
                   round_.bytes_inbound, through_relay, transport)


def paths(members: Sequence[Member], streams: bool) -> tuple[list[tuple[list[str], int]], list[bool]]:
    """Where to dial every participant (group by group, rank by rank): its TCP endpoint, or with `streams` its
    libp2p peer id when it takes streams; and whether each is dialled so."""
    endpoints, over_streams = [], []
    for member in members:
        for rank, (hosts, port) in enumerate(member.endpoints):
            peer = member.p2p[rank] if streams and member.p2p else ""
            endpoints.append(([peer], 0) if peer else (list(hosts), port))
            over_streams.append(bool(peer))
    return endpoints, over_streams


class GroupRounds:
    """This rank's side of the swarm's rounds when worker groups average as wholes (``SwarmPeer.average`` hands
    its calls here): the group's rank 0 finds the round's groups (one matchmaking per group, its ``match_only``
    averager gathering every group's shape, endpoints and weight), the group's ranks learn them from it, and every
    rank runs its part of the round. Collective over the group's ranks.

    :param matcher: rank 0's ``SwarmAverager`` made with ``match_only``; None on the other ranks.
    :param rank: this rank in its group; ``shape``: the group's; ``model_shapes``: every parameter's full shape, in
        the model's order.
    :param endpoints: every rank's endpoint, in rank order (this rank's ``listener`` accepts on its own).
    :param broadcast: rank 0's object on every rank of the group.
    :param replicas: passes replicas' slices (None: the group has no replicas).
    :param timeout: seconds any single step of a round may take (a silent groupmate is dropped after it) when
        `deadlines` is None.
    :param deadlines: rank 0: the deadlines of its rounds (``diloco.swarm.rounds.deadline.Deadlines``, from
        ``--hv.averaging-timeout``; with auto they follow the group's recent rounds); rank 0 records each round it
        ran there, and each round's per-step timeout goes to the group's other ranks with the round (None: every
        round's steps take `timeout`; the other ranks' own is never used).
    :param fragments: with ``--hv.fragments``: the indices of each fragment's parameters (``diloco.outer.fragments``);
        a round of fragment f is laid out over those parameters alone. None: rounds are of the whole model.
    :param connect: reaches other ranks' listeners over TCP, and with a ``tunnel`` (a
        ``diloco.swarm.rounds.tunnel.Tunnel``, which also brings their streams to ``listener``) ranks that take libp2p
        streams at their peer id. ``close()`` closes both.
    :param p2p: per rank, the libp2p peer id at which it takes streams ("": none), announced with the group.
    :param aggregation: how this rank combines the contributions to the spans it reduces (``--hv.aggregation``).
    :param key: the swarm key (``diloco.swarm.records.swarm_key``): announcements without its MAC are left out of the
        round, and the round's handshakes are keyed with it too. None: an open swarm.
    :param signer: this rank's own signing key (None: a new one, for a one-rank group).
    :param public_keys: every rank's public key (``hello.public_bytes``), in rank order; rank 0 announces them (None:
        a one-rank group's own).
    :param model: the group's model fingerprint, announced: a round leaves out members of another model.
    """

    def __init__(
        self,
        matcher: object | None,
        *,
        rank: int,
        shape: Shape,
        model_shapes: Sequence[Sequence[int]],
        endpoints: Sequence[Endpoint],
        broadcast: Callable[[object], object],
        listener: Listener,
        codec: tcp.Codec | Callable[[Sequence[Sequence[int]]], tcp.Codec],
        timeout: float,
        replicas: Replicas | None,
        connect: tcp.Connect = tcp.connect,
        tunnel: object | None = None,
        fragments: Sequence[Sequence[int]] | None = None,
        aggregation: Aggregation = "mean",
        key: SwarmKey | None = None,
        signer: Ed25519PrivateKey | None = None,
        public_keys: Sequence[bytes] | None = None,
        model: str = "",
        deadlines: Deadlines | None = None,
        dialable: Sequence[bool] | None = None,
        reach: str = "",
        relayed: Sequence[bool] | None = None,
        p2p: Sequence[str] | None = None,
    ):
        self.aggregation, self.key, self.model, self.deadlines = aggregation, key, model, deadlines
        self.signer = Ed25519PrivateKey.generate() if signer is None else signer
        if public_keys is None and shape.world_size != 1:
            raise ValueError("a group of several ranks announces every rank's public key")
        self.public_keys = tuple(public_keys) if public_keys is not None else (public_bytes(self.signer),)
        if len(self.public_keys) != shape.world_size or self.public_keys[rank] != public_bytes(self.signer):
            raise ValueError(f"rank {rank}'s key is not at its place among the group's {shape.world_size}")
        self.matcher, self.rank, self.shape, self.model_shapes = matcher, rank, shape, [tuple(s) for s in model_shapes]
        self.endpoints = tuple((tuple(hosts), int(port)) for hosts, port in endpoints)
        self.broadcast, self.listener, self.codec, self.timeout, self.replicas = (
            broadcast, listener, codec, timeout, replicas
        )  # fmt: skip
        self.layout = group_layout(self.model_shapes, shape)[rank]  # this rank's part of the canonical vector
        self.connect, self.tunnel = connect, tunnel
        self.fragments = [list(f) for f in fragments] if fragments else None
        self.malformed = 0  # announcements left out of rounds for a form this version cannot read
        self.dialable = tuple(bool(d) for d in dialable) if dialable is not None else (True,) * shape.world_size
        if len(self.dialable) != shape.world_size:
            raise ValueError(f"{len(self.dialable)} reachabilities for {shape.world_size} ranks")
        self.p2p = tuple(str(p) for p in p2p) if p2p is not None else ("",) * shape.world_size
        self.relayed = tuple(bool(r) for r in relayed) if relayed is not None else (False,) * shape.world_size
        if len(self.relayed) != shape.world_size:
            raise ValueError(f"{len(self.relayed)} relay flags for {shape.world_size} ranks")
        # rank 0's own (``reachability``: direct, outbound only, relayed, unchecked; "": not checked)
        self.reach = reach
        self._alone_warned = False

    def codec_for(self, shapes: Sequence[Sequence[int]]) -> tcp.Codec:
        """The rounds' codec for a vector of these parameters' shapes (a sparse codec knows its chunks)."""
        return self.codec if isinstance(self.codec, tcp.Codec) else self.codec(shapes)

    def image(self, values: torch.Tensor, fragment: int | None = None) -> torch.Tensor:
        """What a round carries of this rank's `values` (its local buffer of `fragment`): they decoded from their
        encoding, chunk by chunk as the rounds cut them (sparse rounds; other codecs: the values)."""
        from diloco.swarm.rounds.sparse import image

        shapes = self._shapes(fragment)
        codec = self.codec_for(shapes)
        if codec.chunks is None:
            return values
        out = torch.empty_like(values)
        for piece in rank_layout(shapes, self.shape, self.rank).held:
            local = slice(piece.local, piece.local + piece.numel)
            out[local] = image(codec, values[local], piece.start)
        return out

    def _shapes(self, fragment: int | None) -> list[tuple[int, ...]]:
        if fragment is not None and self.fragments is not None:
            return [self.model_shapes[i] for i in self.fragments[fragment]]
        return self.model_shapes

    def close(self) -> None:
        """Stop taking connections (the tunnel's streams first)."""
        close_with_tunnel(self.listener, self.tunnel)

    def average(self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: Callable[[], bool],
                fragment: int | None = None, outer_step: int | None = None):  # fmt: skip
        """Collective: one round (see ``SwarmAverager.average`` for the contract), averaged in place: after a round
        that failed the tensors hold averages where they arrived (the caller applies nothing then). With
        `fragment`, the tensors hold this rank's shard of that fragment's parameters. Returns a ``RoundReport``."""
        shapes = self._shapes(fragment)
        with self.listener.in_round():  # groupmates that learn of the round first may connect meanwhile
            return self._average(tensors, round_index, weight, stop, shapes, outer_step)

    def _average(self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: Callable[[], bool],
                 shapes: Sequence[Sequence[int]], outer_step: int | None):  # fmt: skip
        from diloco.swarm.rounds.report import RoundReport, round_id

        started = time.monotonic()
        found = None
        if self.matcher is not None:  # the round's per-step timeout goes with it: the group's ranks use rank 0's
            timeout = self.timeout if self.deadlines is None else self.deadlines.step_timeout(round_bytes(shapes))
            found = (*self._match(round_index, weight, stop, outer_step), timeout)
        info, num_peers, ok, behind, timeout = self.broadcast(found)
        if info is None:
            return RoundReport(num_peers, time.monotonic() - started, 0, 0, ok, behind=behind)
        formed = time.monotonic()
        # in place: no second copy of the pseudo-gradient (the trainer's one tensor is viewed flat, not copied)
        vector = tcp.flatten(list(tensors))
        codec = self.codec_for(shapes)
        outcome = run_round(info, self.rank, shapes, vector, vector, listener=self.listener,
                            codec=codec, timeout=timeout, signer=self.signer, connect=self.connect,
                            streams=self.tunnel is not None,
                            aggregation=self.aggregation)  # fmt: skip
        if self.replicas is not None:  # collective: also when this rank's part failed
            held = rank_layout(shapes, self.shape, self.rank).held
            self.replicas.fill(vector, replica_bounds(held, self.shape.grid()[1], codec.chunks))
        if outcome.ok and len(tensors) > 1:
            tcp.unflatten_into(vector, list(tensors))
        ended = time.monotonic()
        if self.matcher is not None and self.deadlines is not None:  # rank 0's part stands for its group's
            self.deadlines.record(ended - formed, tcp.ROUND_STEPS * timeout, outcome.ok)
        return RoundReport(
            len(info.members), ended - started, outcome.bytes_sent, outcome.bytes_received, outcome.ok,
            rejected=outcome.rejected, transport=outcome.transport, allreduce_seconds=ended - formed,
            round_id=round_id(info.group_id), dropped=outcome.dropped, bytes_inbound=outcome.bytes_inbound,
            bytes_relayed=outcome.bytes_relayed,
        )  # fmt: skip

    def _match(self, round_index: int, weight: float, stop: Callable[[], bool], outer_step: int | None
               ) -> tuple[RoundInfo | None, int, bool, bool]:  # fmt: skip
        """Rank 0: (the round, or None; groups in it; ok; behind). A group behind the others' outer step sits the
        round out (``abreast``): no round, not ok (it applies nothing), behind."""
        mine = {"shape": [self.shape.strategy, self.shape.world_size, self.shape.nodes],
                "endpoints": [[list(hosts), port] for hosts, port in self.endpoints], "weight": weight,
                "keys": [k.hex() for k in self.public_keys]}  # fmt: skip
        if self.model:
            mine["model"] = self.model
        if not all(self.dialable):  # (a group all of whose ranks can be dialled announces as earlier versions did)
            mine["dialable"] = list(self.dialable)
        if any(self.relayed):  # (read by earlier versions as dialable ranks: they are, through the relay)
            mine["relayed"] = list(self.relayed)
        if any(self.p2p):  # (earlier versions dial its ranks over TCP, as every group that does not prefer p2pd)
            mine["p2p"] = list(self.p2p)
        if outer_step is not None:
            mine["outer_step"] = outer_step
        # a keyed announcement's MAC binds it to this round and to the announcing peer: replayed into another round
        # or by another peer, it is left out
        context = _context(round_index, getattr(self.matcher, "peer_id", ""))
        announcement = self.key.sign_member(mine, *context) if self.key else mine
        match, report = self.matcher.match(round_index, announcement, stop)
        if match is None:
            if not self.dialable[0] and not self._alone_warned:
                self._alone_warned = True  # (a group nobody can dial never leads a matchmaking: it only joins)
                log.warning("averaging: this group cannot be dialled (outbound only) and found no group in the swarm "
                            "that can: its rounds form once a group that accepts connections joins")  # fmt: skip
            return None, report.num_peers, report.ok, False
        gathered, me, group_id = list(match.gathered), match.index, match.group_id
        if self.key is not None:  # every member sees the same announcements: all leave out the same ones
            peers = match.peers or ("",) * len(gathered)
            signed = [self.key.member_signed(entry, *_context(round_index, peer))
                      for entry, peer in zip(gathered, peers)]  # fmt: skip
            if (left_out := sum(entry is None for entry in signed)) > 0:
                log.warning("averaging: %d group(s) in this round announced themselves without this swarm's key; "
                            "averaging without them", left_out)  # fmt: skip
            me = sum(entry is not None for entry in signed[:me])
            gathered, group_id = [entry for entry in signed if entry is not None], self.key.round_secret(group_id)
        # every member reads the same announcements alike, so all leave out the same unreadable ones (and those that
        # announce no key per rank: nobody could tell their connections from an impostor's)
        parsed = [announced(entry) for entry in gathered]
        valid = [i for i, member in enumerate(parsed) if member is not None and member.keys]
        if len(valid) < len(parsed):
            self.malformed += len(parsed) - len(valid)
            warn = log.warning if self.malformed == len(parsed) - len(valid) else log.debug  # (once, then debug)
            warn("averaging: %d group(s) in this round announced themselves in a form this version cannot read "
                 "(another version, or a stranger); averaging without them", len(parsed) - len(valid))  # fmt: skip
        if me not in valid:  # (this group's own announcement: never)
            return None, len(gathered), False, False
        gathered, parsed, me = [gathered[i] for i in valid], [parsed[i] for i in valid], valid.index(me)
        kept = abreast([entry.get("outer_step") for entry in gathered], round_index)
        if me not in kept:
            log.warning("averaging: this group is at outer step %s, others in the round at a later one: it sits the "
                        "round out and applies nothing", outer_step)  # fmt: skip
            return None, len(gathered), False, True
        members, me = [parsed[i] for i in kept], kept.index(me)
        kept = same_model([member.model for member in members], self.model)
        if len(kept) < len(members):
            log.warning("averaging: %d group(s) in this round announced another model than this one's; averaging "
                        "without them", len(members) - len(kept))  # fmt: skip
        members, me = tuple(members[i] for i in kept), kept.index(me)
        if len(members) < 2:
            return None, len(members), True, False  # alone among strangers: as a round of one
        return RoundInfo(group_id, members, me, sealed=self.key is not None), len(members), True, False


def _context(round_index: int, peer_id: str) -> tuple[bytes, bytes]:
    """What a keyed announcement's MAC binds it to besides its contents: the round and the announcing peer."""
    return str(round_index).encode(), peer_id.encode()


def announced(entry: object) -> Member | None:
    """A group's matchmaking announcement (``member_of``), or None when it cannot be read as one: whatever a peer
    announces, reading it never raises."""
    try:
        return member_of(entry)
    except Exception:  # noqa: BLE001 - TypeError, ValueError, KeyError, OverflowError, ...: not an announcement
        return None


def member_of(entry: object) -> Member:
    """A group's matchmaking announcement, checked."""
    if not isinstance(entry, dict):
        raise TypeError(f"an announcement of type {type(entry).__name__}")
    strategy, world_size, nodes = entry["shape"]
    if strategy not in STRATEGIES or not 0 < int(world_size) <= 2**16 or not 0 < int(nodes) <= int(world_size):
        raise ValueError(f"shape {entry['shape']}")
    endpoints = tuple((tuple(str(h) for h in hosts), int(port)) for hosts, port in entry["endpoints"])
    if len(endpoints) != int(world_size):
        raise ValueError(f"{len(endpoints)} endpoints for {world_size} ranks")
    weight = float(entry["weight"])
    if not weight >= 0 or weight == float("inf"):
        raise ValueError(f"weight {weight}")
    keys = tuple(bytes.fromhex(key) for key in entry.get("keys", ()))  # (a state's source announces none)
    if keys and (len(keys) != len(endpoints) or any(len(key) != KEY_SIZE for key in keys)):
        raise ValueError(f"{len(keys)} keys for {len(endpoints)} ranks, or a key that is not {KEY_SIZE} bytes")
    model = entry.get("model", "")
    if not isinstance(model, str) or len(model) > 128:
        raise ValueError("a model fingerprint that is no short string")
    def is_flag(value: object) -> bool:
        return type(value) is bool

    dialable = _per_rank(entry, "dialable", len(endpoints), is_flag, "a reachability that is not one bool per rank")
    relayed = _per_rank(entry, "relayed", len(endpoints), is_flag, "relay flags that are not one bool per rank")
    p2p = _per_rank(entry, "p2p", len(endpoints), lambda p: type(p) is str and bool(_PEER_ID.fullmatch(p)),
                    "libp2p peer ids that are not one short base58 string (or none) per rank")  # fmt: skip
    return Member(Shape(strategy, int(world_size), int(nodes)), endpoints, weight, keys, model, dialable, relayed,
                  p2p)  # fmt: skip


def _per_rank(entry: dict, key: str, ranks: int, valid: Callable[[object], bool], why: str) -> tuple:
    """An announcement's optional list of one value per rank under `key` (absent or empty: ``()``); ValueError(`why`)
    for anything else."""
    values = entry.get(key, [])
    if not isinstance(values, list) or (values and len(values) != ranks) or not all(valid(v) for v in values):
        raise ValueError(why)
    return tuple(values)


def abreast(claims: list[object], round_index: int) -> list[int]:
    """The members of round `round_index` that average, by the outer step each announced in matchmaking (None: a
    version from before the field): those at the highest outer step announced, and those that announced none. A
    group behind (its last round failed, and its read of the others' records lagged, so it could not tell) would mix
    a pseudo-gradient of older parameters into the others' round and leave it on another model than theirs: every
    member computes the same list from the same announcements, and the group behind sits the round out (it loads
    their state at its next boundary). No group holds round `round_index`'s outer step or a later one before the
    round: such a claim counts as none, so a stranger cannot send the others out by claiming a huge one."""
    steps = [c if type(c) is int and 0 <= c < round_index else None for c in claims]
    top = max((s for s in steps if s is not None), default=None)
    return [i for i, s in enumerate(steps) if s is None or s == top]


def same_model(models: list[str], mine: str) -> list[int]:
    """The members of a round that average, by the model fingerprint each announced ("": none): those of this
    group's model `mine`, and those that announced none (all, when `mine` is unknown). Groups of one model
    matchmake under one key (``run_key``), so every honest member holds the same `mine` and computes the same list;
    what it leaves out is a stranger's announcement or a misconfigured group, whose vector laid out by another
    model's shapes would garble the average. Unlike a majority rule, no number of strangers' announcements can send
    an honest group out."""
    return [i for i, model in enumerate(models) if not model or not mine or model == mine]

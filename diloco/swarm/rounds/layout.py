"""Where each rank's values sit in the model's canonical vector, and who reduces what when groups of different shapes
average together.

The canonical vector is every parameter, flattened, in the model's parameter order (the order the fingerprint of
``diloco.swarm.records.fingerprint`` hashes, so groups that meet agree on it): ``total`` float32 values. A rank holds a
*local buffer*: its shard of every parameter, concatenated in the same order (what the trainer's outer optimizer
keeps). FSDP2 shards dim 0 as ``torch.chunk`` does, so shard s of a parameter with d0 rows holds rows
``[s·c, (s+1)·c)`` (clipped to d0) with c = ⌈d0 ÷ shards⌉: its values are one run of the canonical vector.

Ranks that hold the same shard (replicas: every rank under NO_SHARD, DDP and ZERO1; the nodes under HYBRID_SHARD)
split its exchange: replica i of R exchanges the i-th of R equal slices of the local buffer, and after the round the
replicas gather the slices from each other over the group's own process group. So within a group every canonical
value is *exchanged* by exactly one rank, and a group's layout follows from its strategy and its numbers of ranks
and nodes alone: the other groups compute it from three numbers.

A round's ``Plan`` cuts the canonical vector at every exchanged run boundary of every participating group; each
resulting span is exchanged by one rank per group (its *holders*) and reduced by one of them, chosen the same way
on every participant (contiguous runs, balanced by values). A reducer averages the groups' contributions to its spans
and sends each holder the average: no rank handles more than its own shard and the spans it reduces.

Plain Python over shapes and integers; no torch.distributed, no network.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from diloco.config import ShardingStrategy
from diloco.swarm.rounds.chunks import Chunks


@dataclass(frozen=True, order=True)
class Piece:
    """A run of the canonical vector, ``[start, stop)``, that sits contiguously at ``local`` in a rank's buffer."""

    start: int
    stop: int
    local: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Shape:
    """How a group is laid out: its sharding strategy, ranks and nodes (HYBRID_SHARD shards within a node)."""

    strategy: ShardingStrategy
    world_size: int
    nodes: int = 1

    def grid(self) -> tuple[int, int]:
        """(shards, replicas): ranks holding distinct parts of each parameter, and copies of each part."""
        if self.strategy in ("NO_SHARD", "DDP", "ZERO1"):
            return 1, self.world_size
        if self.strategy == "HYBRID_SHARD":
            return self.world_size // self.nodes, self.nodes
        return self.world_size, 1

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(shard index, replica index) of `rank`: HYBRID_SHARD's mesh is (nodes, ranks per node), rank-major."""
        shards, _ = self.grid()
        return rank % shards, rank // shards


def row_range(rows: int, shard: int, shards: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 that `shard` of `shards` holds (``torch.chunk`` sizes; trailing shards may be
    empty)."""
    size = math.ceil(rows / shards) if rows else 0
    start = min(shard * size, rows)
    return start, min(start + size, rows)


def held_pieces(shapes: Sequence[Sequence[int]], shard: int, shards: int) -> list[Piece]:
    """The canonical runs a rank holding `shard` of `shards` of every parameter (of `shapes`, in model order) keeps,
    at their offsets in its local buffer; adjacent runs are merged."""
    pieces: list[Piece] = []
    offset = local = 0
    for shape in shapes:
        numel = math.prod(shape)
        rows = shape[0] if shape else 1
        per_row = numel // rows if rows else 0
        first, last = row_range(rows, shard, shards)
        start, stop = offset + first * per_row, offset + last * per_row
        if stop > start:
            if pieces and pieces[-1].stop == start and pieces[-1].local + pieces[-1].numel == local:
                pieces[-1] = Piece(pieces[-1].start, stop, pieces[-1].local)
            else:
                pieces.append(Piece(start, stop, local))
            local += stop - start
        offset += numel
    return pieces


def slice_pieces(pieces: Sequence[Piece], begin: int, end: int) -> list[Piece]:
    """The parts of `pieces` that lie at local offsets ``[begin, end)``."""
    out = []
    for piece in pieces:
        lo, hi = max(begin, piece.local), min(end, piece.local + piece.numel)
        if hi > lo:
            out.append(Piece(piece.start + lo - piece.local, piece.start + hi - piece.local, lo))
    return out


def replica_slice(local_numel: int, replica: int, replicas: int) -> tuple[int, int]:
    """Local offsets ``[begin, end)`` that `replica` of `replicas` exchanges: equal contiguous slices."""
    return replica * local_numel // replicas, (replica + 1) * local_numel // replicas


@dataclass(frozen=True)
class RankLayout:
    """One rank's part: the canonical runs it holds, and the subset it exchanges, both sorted by ``start``."""

    held: tuple[Piece, ...]
    exchanged: tuple[Piece, ...]

    @property
    def local_numel(self) -> int:
        return sum(p.numel for p in self.held)

    @property
    def exchanged_numel(self) -> int:
        return sum(p.numel for p in self.exchanged)

    def local_offset(self, start: int, stop: int) -> int:
        """Where canonical ``[start, stop)``, which must lie inside one exchanged run, sits in the local buffer."""
        i = bisect.bisect_right([p.start for p in self.exchanged], start) - 1
        if i < 0 or stop > self.exchanged[i].stop:
            raise ValueError(f"[{start}, {stop}) is not exchanged by this rank")
        return self.exchanged[i].local + start - self.exchanged[i].start


def replica_bounds(held: Sequence[Piece], replicas: int, chunks: Chunks | None = None) -> list[tuple[int, int]]:
    """Local offsets ``[begin, end)`` each of `replicas` replicas holding `held` exchanges: ``replica_slice``'s,
    with `chunks` moved back to the chunk boundary at or before each cut (a chunk is never split between
    replicas)."""
    local_numel = sum(p.numel for p in held)
    cuts = [replica_slice(local_numel, i, replicas)[0] for i in range(replicas)] + [local_numel]
    if chunks is not None:
        cuts = [_snap_local(held, cut, chunks) for cut in cuts]
    return list(zip(cuts, cuts[1:]))


def _snap_local(held: Sequence[Piece], cut: int, chunks: Chunks) -> int:
    for piece in held:  # pieces begin and end on chunk boundaries (whole rows, whole parameters)
        if piece.local <= cut < piece.local + piece.numel:
            return piece.local + chunks.floor(piece.start + cut - piece.local) - piece.start
    return cut


def rank_layout(shapes: Sequence[Sequence[int]], shape: Shape, rank: int, chunks: Chunks | None = None) -> RankLayout:
    shards, replicas = shape.grid()
    shard, replica = shape.coordinates(rank)
    held = held_pieces(shapes, shard, shards)
    exchanged = slice_pieces(held, *replica_bounds(held, replicas, chunks)[replica])
    return RankLayout(tuple(held), tuple(exchanged))


def group_layout(shapes: Sequence[Sequence[int]], shape: Shape, chunks: Chunks | None = None) -> list[RankLayout]:
    """Every rank's layout in a group of `shape`, computed alike in every group that knows the model's shapes; with
    `chunks` (sparse rounds), replicas split their exchange on chunk boundaries."""
    return [rank_layout(shapes, shape, rank, chunks) for rank in range(shape.world_size)]


@dataclass(frozen=True)
class Span:
    """``[start, stop)`` of the canonical vector, exchanged by ``holders[g]`` (a rank) of each group g and reduced
    by rank ``reducer[1]`` of group ``reducer[0]``."""

    start: int
    stop: int
    holders: tuple[int, ...]
    reducer: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Plan:
    """The spans of one round, in canonical order, for groups in the round's order (the same on every
    participant: hivemind's group order)."""

    total: int
    spans: tuple[Span, ...]

    def reduced_by(self, participant: tuple[int, int]) -> list[Span]:
        """The spans `participant` (group, rank) reduces, in order."""
        return [s for s in self.spans if s.reducer == participant]


def _owner_runs(layout: Sequence[RankLayout]) -> tuple[list[int], list[int]]:
    """(run starts, exchanging rank of each run) of one group over the canonical vector, sorted by start."""
    runs = sorted((p.start, p.stop, rank) for rank, r in enumerate(layout) for p in r.exchanged)
    return [start for start, _, _ in runs], [rank for _, _, rank in runs]


class Unreduced(ValueError):
    """A span of the round has no holder that others can dial: nobody may reduce it."""


def plan(groups: Sequence[Sequence[RankLayout]], total: int, chunks: Chunks | None = None,
         reducers: Sequence[Sequence[bool]] | None = None) -> Plan:  # fmt: skip
    """Cut ``[0, total)`` at every group's exchange boundaries and give each span a reducer among its holders.

    Every participant (a rank of a group) should reduce about its share, total ÷ participants, but can reduce only
    what it exchanges. Walking the vector in order, the current reducer keeps taking values while it holds them and
    has room left (contiguous runs keep messages few); otherwise the holder that most needs this span to reach its
    share (its room minus what it holds further on) takes over, ties to the lower (group, rank). A span is split
    where a reducer's share ends (with `chunks`: on the chunk boundary at or before it, or the chunk's end).
    Everyone computes the same plan from the same layouts.

    `reducers` (per group, per rank; default: all): which participants may reduce, those others can dial (a rank
    behind a home router only sends, and receives the averages over its own connections). Shares are then of the
    values over those alone; a span whose holders are none of them raises ``Unreduced``.
    """
    owners = [_owner_runs(layout) for layout in groups]
    for g, layout in enumerate(groups):
        covered = sum(p.numel for r in layout for p in r.exchanged)
        if covered != total:
            raise ValueError(f"group {g} exchanges {covered} values of {total}")
    cuts = sorted({0, total, *(p.stop for layout in groups for r in layout for p in r.exchanged)})
    may = reducers if reducers is not None else [[True] * len(layout) for layout in groups]
    if [len(m) for m in may] != [len(layout) for layout in groups]:
        raise ValueError("reducers does not name every rank of every group")
    participants = sum(sum(map(bool, m)) for m in may)
    share = math.ceil(total / participants) if participants else 0
    ahead = {(g, r): layout[r].exchanged_numel for g, layout in enumerate(groups) for r in range(len(layout))}
    load = dict.fromkeys(ahead, 0)
    current: tuple[int, int] | None = None
    spans = []
    for start, stop in zip(cuts, cuts[1:]):
        holders = tuple(ranks[bisect.bisect_right(starts, start) - 1] for starts, ranks in owners)
        candidates = [(g, rank) for g, rank in enumerate(holders) if may[g][rank]]
        if not candidates:
            raise Unreduced(f"values [{start}, {stop}) are held only by ranks nobody can dial (outbound only): "
                            "no rank of this round may reduce them, so it cannot run; a group that accepts "
                            "connections must take part")  # fmt: skip
        while start < stop:
            left = stop - start

            def need(c: tuple[int, int]) -> int:  # what c must take here to reach its share
                return share - load[c] - (ahead[c] - left)

            open_ = [c for c in candidates if load[c] < share] or candidates
            keep = current in open_ and need(current) >= max(need(c) for c in open_)
            if not keep and not (current in open_ and max(need(c) for c in open_) <= 0):
                current = max(open_, key=lambda c: (need(c), -c[0], -c[1]))
            take = min(left, share - load[current]) if load[current] < share else left
            if chunks is not None and take < left:
                cut = chunks.floor(start + take)
                take = (cut if cut > start else chunks.ceil(start + 1)) - start
            if spans and spans[-1].stop == start and (spans[-1].holders, spans[-1].reducer) == (holders, current):
                spans[-1] = Span(spans[-1].start, start + take, holders, current)
            else:
                spans.append(Span(start, start + take, holders, current))
            load[current] += take
            for c in enumerate(holders):
                ahead[c] -= take
            start += take
    return Plan(total, tuple(spans))


# ---------------------------------------------------------------- what the transport runs


@dataclass(frozen=True)
class Part:
    """A part of a reducer's work: canonical ``[start, stop)``, the participants that contribute it (the reducer
    among them), and where it sits in this participant's buffer (None: this participant does not take part in it)."""

    start: int
    stop: int
    senders: tuple[int, ...]
    local: int | None

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Schedule:
    """One participant's view of a round: per participant j, the parts j reduces, in the order they travel.

    Every participant of a round derives the same parts and senders; only ``local`` differs. ``digest`` hashes what
    they share, so two participants that would disagree on the bytes refuse each other's connections instead.
    """

    me: int
    parts: tuple[tuple[Part, ...], ...]

    @property
    def digest(self) -> bytes:
        h = hashlib.sha256()
        for j, parts in enumerate(self.parts):
            for part in parts:
                h.update(f"{j}:{part.start}:{part.stop}:{part.senders};".encode())
        return h.digest()

    def sent_to(self, reducer: int) -> list[Part]:
        """The parts of `reducer` this participant contributes, in order."""
        return [p for p in self.parts[reducer] if self.me in p.senders]


def flat_parts(numel: int, group_size: int, part_numel: int) -> tuple[int, list[range]]:
    """(values per part, part indices of each reducer) when every participant holds the whole vector. Parts hold
    at most ``part_numel`` values, fewer when that gives every reducer a part; reducer j owns parts
    ``[j*C//k, (j+1)*C//k)`` of the C parts."""
    size = max(1, min(part_numel, -(-numel // group_size)))
    count = -(-numel // size)
    return size, [range(j * count // group_size, (j + 1) * count // group_size) for j in range(group_size)]


def flat_schedule(numel: int, group_size: int, part_numel: int, me: int) -> Schedule:
    """Every participant holds the whole vector (groups of one shape, rank r with rank r): all contribute every
    part, at its own offset."""
    size, spans = flat_parts(numel, group_size, part_numel)
    everyone = tuple(range(group_size))
    return Schedule(me, tuple(
        tuple(Part(q * size, min((q + 1) * size, numel), everyone, q * size) for q in span) for span in spans
    ))  # fmt: skip


def plan_schedule(round_plan: Plan, groups: Sequence[Sequence[RankLayout]], me: tuple[int, int],
                  part_numel: int, chunks: Chunks | None = None) -> Schedule:  # fmt: skip
    """Participant `me` (group, rank)'s view of `round_plan`; participants are numbered group by group, rank by
    rank. Each span travels in parts of at most `part_numel` values (with `chunks`: of whole chunks)."""
    first = [sum(len(layout) for layout in groups[:g]) for g in range(len(groups))]
    mine = groups[me[0]][me[1]]
    parts: list[list[Part]] = [[] for _ in range(sum(len(layout) for layout in groups))]
    for span in round_plan.spans:
        senders = tuple(first[g] + rank for g, rank in enumerate(span.holders))
        reducer = first[span.reducer[0]] + span.reducer[1]
        takes_part = span.holders[me[0]] == me[1]
        runs = chunks.runs(span.start, span.stop, part_numel) if chunks is not None else [
            (start, min(start + part_numel, span.stop)) for start in range(span.start, span.stop, part_numel)]
        for start, stop in runs:
            parts[reducer].append(Part(start, stop, senders, mine.local_offset(start, stop) if takes_part else None))
    return Schedule(first[me[0]] + me[1], tuple(tuple(p) for p in parts))

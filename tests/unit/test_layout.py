"""The canonical layout and a round's plan (`diloco.swarm.rounds.layout`): FSDP2's row chunks, replicas splitting their
exchange, and a simulated round over groups of different shapes leaving every rank with the weighted average."""

from __future__ import annotations

import math
import random

import pytest
import torch

from diloco.swarm.rounds.layout import (
    Plan,
    RankLayout,
    Shape,
    Unreduced,
    group_layout,
    held_pieces,
    plan,
    row_range,
)

SHAPES = [(64, 32), (32,), (96, 32), (32,), (100, 32), (7,), (3, 5, 2)]
TOTAL = sum(math.prod(s) for s in SHAPES)
MIXES = [
    [Shape("FULL_SHARD", 1), Shape("FULL_SHARD", 1)],
    [Shape("FULL_SHARD", 1), Shape("FULL_SHARD", 2)],
    [Shape("NO_SHARD", 2), Shape("FULL_SHARD", 2)],
    [Shape("SHARD_GRAD_OP", 3), Shape("DDP", 2), Shape("HYBRID_SHARD", 4, nodes=2)],
    [Shape("FULL_SHARD", 3), Shape("FULL_SHARD", 2), Shape("ZERO1", 1)],
]


@pytest.mark.parametrize("rows", range(0, 11))
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_row_ranges_are_torch_chunks_padded_with_empty_shards(rows: int, shards: int) -> None:
    chunks = [c.tolist() for c in torch.chunk(torch.arange(rows), shards)] if rows else []
    chunks += [[]] * (shards - len(chunks))
    assert [list(range(*row_range(rows, s, shards))) for s in range(shards)] == chunks


def test_held_pieces_of_all_shards_tile_the_vector_and_merge_adjacent_runs() -> None:
    for shards in (1, 2, 3, 5):
        pieces = [p for s in range(shards) for p in held_pieces(SHAPES, s, shards)]
        covered = sorted(i for p in pieces for i in range(p.start, p.stop))
        assert covered == list(range(TOTAL))
    assert len(held_pieces(SHAPES, 0, 1)) == 1  # one rank: the whole vector, one run
    second = held_pieces([(4, 2), (4, 2)], 1, 2)  # rows 2-3 of each: canonical 4-8 and 12-16
    assert [(p.start, p.stop, p.local) for p in second] == [(4, 8, 0), (12, 16, 4)]


@pytest.mark.parametrize("shape", [Shape("NO_SHARD", 3), Shape("FULL_SHARD", 3), Shape("HYBRID_SHARD", 4, nodes=2)])
def test_each_value_is_exchanged_by_exactly_one_rank_of_a_group(shape: Shape) -> None:
    layout = group_layout(SHAPES, shape)
    exchanged = sorted(i for r in layout for p in r.exchanged for i in range(p.start, p.stop))
    assert exchanged == list(range(TOTAL))
    for r in layout:  # what a rank exchanges it holds, at the same local offsets
        held = {(i, p.local + i - p.start) for p in r.held for i in range(p.start, p.stop)}
        assert {(i, p.local + i - p.start) for p in r.exchanged for i in range(p.start, p.stop)} <= held


def local_buffer(vector: torch.Tensor, rank: RankLayout) -> torch.Tensor:
    return torch.cat([vector[p.start : p.stop] for p in rank.held]) if rank.held else torch.zeros(0)


def simulate(groups: list[list[RankLayout]], shapes: list[Shape], buffers: list[list[torch.Tensor]],
             weights: list[float], round_plan: Plan) -> None:  # fmt: skip
    """A round as the transport and the group's collectives will run it, in place on the ranks' buffers."""
    for span in round_plan.spans:
        reducer_group, reducer_rank = span.reducer
        assert span.holders[reducer_group] == reducer_rank  # a reducer holds its spans
        parts = []
        for g, rank in enumerate(span.holders):
            at = groups[g][rank].local_offset(span.start, span.stop)
            parts.append(buffers[g][rank][at : at + span.numel].clone())
        average = sum(w * part for w, part in zip(weights, parts)) / sum(weights)
        for g, rank in enumerate(span.holders):
            at = groups[g][rank].local_offset(span.start, span.stop)
            buffers[g][rank][at : at + span.numel] = average
    for g, shape in enumerate(shapes):  # replicas gather the slices the others exchanged
        shards, _ = shape.grid()
        for rank, layout in enumerate(groups[g]):
            for other, theirs in enumerate(groups[g]):
                if other != rank and shape.coordinates(other)[0] == shape.coordinates(rank)[0]:
                    for p in theirs.exchanged:
                        buffers[g][rank][p.local : p.local + p.numel] = buffers[g][other][p.local : p.local + p.numel]


@pytest.mark.parametrize("mix", MIXES, ids=lambda mix: "+".join(f"{s.strategy}x{s.world_size}" for s in mix))
def test_a_round_over_groups_of_different_shapes_leaves_every_rank_with_the_average(mix: list[Shape]) -> None:
    generator = torch.Generator().manual_seed(len(mix))
    vectors = [torch.randn(TOTAL, generator=generator, dtype=torch.float64) for _ in mix]
    weights = [random.Random(i).uniform(0.5, 2.0) for i in range(len(mix))]
    groups = [group_layout(SHAPES, shape) for shape in mix]
    buffers = [[local_buffer(v, r) for r in layout] for v, layout in zip(vectors, groups)]
    round_plan = plan(groups, TOTAL)
    assert [(s.start, s.stop) for s in round_plan.spans] == sorted((s.start, s.stop) for s in round_plan.spans)
    assert round_plan.spans[0].start == 0 and round_plan.spans[-1].stop == TOTAL
    assert all(a.stop == b.start for a, b in zip(round_plan.spans, round_plan.spans[1:]))
    simulate(groups, mix, buffers, weights, round_plan)
    expected = sum(w * v for w, v in zip(weights, vectors)) / sum(weights)
    for layout, ranks in zip(groups, buffers):
        for rank, buffer in zip(layout, ranks):
            torch.testing.assert_close(buffer, local_buffer(expected, rank), rtol=0, atol=1e-12)


@pytest.mark.parametrize("mix", MIXES, ids=lambda mix: "+".join(f"{s.strategy}x{s.world_size}" for s in mix))
def test_reducers_share_the_work_evenly_in_few_runs(mix: list[Shape]) -> None:
    groups = [group_layout(SHAPES, shape) for shape in mix]
    round_plan = plan(groups, TOTAL)
    participants = [(g, r) for g, layout in enumerate(groups) for r in range(len(layout))]
    loads = {p: sum(s.numel for s in round_plan.reduced_by(p)) for p in participants}
    share = TOTAL / len(participants)
    assert sum(loads.values()) == TOTAL
    assert max(loads.values()) <= 1.3 * share, loads  # nobody reduces much more than its share
    if all(shape == mix[0] for shape in mix):  # groups alike: exactly even, one run each
        assert max(loads.values()) - min(loads.values()) <= 1 and len(round_plan.spans) <= len(participants) * 8


def test_the_plan_is_the_same_however_often_it_is_computed_and_refuses_a_group_that_misses_values() -> None:
    groups = [group_layout(SHAPES, s) for s in MIXES[3]]
    assert plan(groups, TOTAL) == plan([group_layout(SHAPES, s) for s in MIXES[3]], TOTAL)
    with pytest.raises(ValueError, match="group 1 exchanges"):
        plan([groups[0], groups[1][:1]], TOTAL)


@pytest.mark.parametrize("mix", MIXES[1:], ids=lambda mix: "+".join(f"{s.strategy}x{s.world_size}" for s in mix))
def test_ranks_nobody_can_dial_reduce_nothing_and_the_round_still_averages(mix: list[Shape]) -> None:
    """Every group but the first is behind a router (outbound only): the first group's ranks reduce every span,
    about evenly, and the simulated round still leaves every rank with the weighted average."""
    groups = [group_layout(SHAPES, shape) for shape in mix]
    reducers = [[g == 0] * len(layout) for g, layout in enumerate(groups)]
    round_plan = plan(groups, TOTAL, reducers=reducers)
    assert {s.reducer[0] for s in round_plan.spans} == {0}
    loads = [sum(s.numel for s in round_plan.reduced_by((0, r))) for r in range(len(groups[0]))]
    assert sum(loads) == TOTAL and max(loads) <= 1.3 * TOTAL / len(loads), loads
    generator = torch.Generator().manual_seed(7)
    vectors = [torch.randn(TOTAL, generator=generator, dtype=torch.float64) for _ in mix]
    buffers = [[local_buffer(v, r) for r in layout] for v, layout in zip(vectors, groups)]
    simulate(groups, mix, buffers, [1.0] * len(mix), round_plan)
    expected = sum(vectors) / len(vectors)
    for layout, ranks in zip(groups, buffers):
        for rank, buffer in zip(layout, ranks):
            torch.testing.assert_close(buffer, local_buffer(expected, rank), rtol=0, atol=1e-12)


def test_a_plan_where_everyone_can_be_dialled_is_the_plan_of_earlier_versions_and_one_nobody_can_dial_is_refused():
    groups = [group_layout(SHAPES, s) for s in MIXES[3]]
    everyone = [[True] * len(layout) for layout in groups]
    assert plan(groups, TOTAL, reducers=everyone) == plan(groups, TOTAL)
    with pytest.raises(Unreduced, match="nobody can dial"):
        plan(groups, TOTAL, reducers=[[False] * len(layout) for layout in groups])
    # one 2-rank FULL_SHARD group's rank 1 behind a router: the rows only it and other outbound ranks hold cannot be
    # reduced
    pair = [group_layout(SHAPES, Shape("FULL_SHARD", 2)), group_layout(SHAPES, Shape("FULL_SHARD", 1))]
    with pytest.raises(Unreduced):
        plan(pair, TOTAL, reducers=[[True, False], [False]])
    with pytest.raises(ValueError, match="every rank"):
        plan(pair, TOTAL, reducers=[[True], [True]])

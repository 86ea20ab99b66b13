"""The shape-independent digest (`diloco.swarm.rounds.digest`): equal for equal parameters in groups of any shape, and
different when any value differs, wherever it sits."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.swarm.rounds.digest import CanonicalDigest
from diloco.swarm.rounds.layout import RankLayout, Shape, group_layout

# wide rows (one sha256 each), narrow rows (mixed value by value), 1-D params, odd row counts
SHAPES = [(64, 32), (32,), (33, 16), (7, 3), (5,), (3, 5, 2), (10, 64)]
TOTAL = sum(math.prod(s) for s in SHAPES)
GROUPS = [Shape("FULL_SHARD", 1), Shape("FULL_SHARD", 2), Shape("FULL_SHARD", 3), Shape("NO_SHARD", 2),
          Shape("DDP", 3), Shape("HYBRID_SHARD", 4, nodes=2), Shape("SHARD_GRAD_OP", 5)]  # fmt: skip


def local(vector: torch.Tensor, rank: RankLayout) -> torch.Tensor:
    return torch.cat([vector[p.start : p.stop] for p in rank.held]) if rank.held else torch.zeros(0)


def group_digest(vector: torch.Tensor, shape: Shape) -> str:
    layout = group_layout(SHAPES, shape)
    return CanonicalDigest.combine(CanonicalDigest(SHAPES, r).partial(local(vector, r)) for r in layout)


def test_groups_of_any_shape_holding_one_vector_have_one_digest() -> None:
    vector = torch.randn(TOTAL)
    digests = {group_digest(vector, shape) for shape in GROUPS}
    assert len(digests) == 1 and len(digests.pop()) == 32


@pytest.mark.parametrize("shape", [Shape("FULL_SHARD", 1), Shape("FULL_SHARD", 3), Shape("HYBRID_SHARD", 4, nodes=2)])
def test_any_changed_value_or_swapped_pair_changes_the_digest(shape: Shape) -> None:
    vector = torch.randn(TOTAL)
    reference = group_digest(vector, shape)
    for index in (0, 31, 64 * 32, 64 * 32 + 40, TOTAL - 1):  # a wide row, a 1-D parameter, a narrow row, the end
        changed = vector.clone()
        changed[index] = torch.nextafter(changed[index], torch.tensor(math.inf))  # the smallest change there is
        assert group_digest(changed, shape) != reference, index
    swapped = vector.clone()
    swapped[[3, 40]] = vector[[40, 3]]  # same values, other places
    assert group_digest(swapped, shape) != reference
    assert group_digest(-vector, shape) != reference

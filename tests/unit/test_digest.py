"""The shape-independent digest (`diloco.swarm.rounds.digest`): equal for equal parameters in groups of any shape, and
different when any value differs, wherever it sits, even in a state built to collide."""

from __future__ import annotations

import hashlib
import math
import pickle

import numpy as np
import pytest
import torch

from diloco.swarm.rounds.digest import LANES, CanonicalDigest
from diloco.swarm.rounds.layout import RankLayout, Shape, group_layout

# wide rows, narrow rows (1-D params: one value a row), odd row counts
SHAPES = [(64, 32), (32,), (33, 16), (7, 3), (5,), (3, 5, 2), (10, 64)]
TOTAL = sum(math.prod(s) for s in SHAPES)
GROUPS = [Shape("FULL_SHARD", 1), Shape("FULL_SHARD", 2), Shape("FULL_SHARD", 3), Shape("NO_SHARD", 2),
          Shape("DDP", 3), Shape("HYBRID_SHARD", 4, nodes=2), Shape("SHARD_GRAD_OP", 5)]  # fmt: skip
NARROW = 64 * 32  # canonical index of the first value of the (32,) parameter: 32 rows of one value


def local(vector: torch.Tensor, rank: RankLayout) -> torch.Tensor:
    return torch.cat([vector[p.start : p.stop] for p in rank.held]) if rank.held else torch.zeros(0)


def group_digest(vector: torch.Tensor, shape: Shape) -> str:
    layout = group_layout(SHAPES, shape)
    return CanonicalDigest.combine(CanonicalDigest(SHAPES, r).partial(local(vector, r)) for r in layout)


def rows() -> list[tuple[int, int]]:
    """(canonical start, width) of every row of SHAPES."""
    found, offset = [], 0
    for shape in SHAPES:
        count = shape[0]
        width = math.prod(shape) // count
        found += [(offset + r * width, width) for r in range(count)]
        offset += math.prod(shape)
    return found


def test_groups_of_any_shape_holding_one_vector_have_one_digest() -> None:
    vector = torch.randn(TOTAL)
    digests = {group_digest(vector, shape) for shape in GROUPS}
    assert len(digests) == 1 and len(digests.pop()) == 64


def test_a_ranks_part_is_bytes_of_lanes_that_survive_the_gather() -> None:
    """Parts travel between a group's ranks as pickled objects (``all_gather_object``); any order adds up alike."""
    vector = torch.randn(TOTAL)
    layout = group_layout(SHAPES, Shape("FULL_SHARD", 3))
    parts = [CanonicalDigest(SHAPES, r).partial(local(vector, r)) for r in layout]
    assert all(isinstance(p, bytes) and len(p) == 2 * LANES for p in parts)
    travelled = pickle.loads(pickle.dumps(parts))
    assert CanonicalDigest.combine(travelled[::-1]) == CanonicalDigest.combine(parts) == group_digest(vector, GROUPS[0])


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
    rows_swapped = vector.clone()
    rows_swapped[0:32], rows_swapped[32:64] = vector[32:64], vector[0:32]  # two whole rows trade places
    assert group_digest(rows_swapped, shape) != reference


@pytest.mark.parametrize("shape", [Shape("FULL_SHARD", 1), Shape("FULL_SHARD", 3)])
def test_one_flipped_bit_in_any_row_changes_the_digest(shape: Shape) -> None:
    """Every row, wide or of one value, is hashed whole: one bit anywhere in it (sign, exponent or mantissa)
    changes the digest."""
    vector = torch.randn(TOTAL)
    reference = group_digest(vector, shape)
    rng = np.random.default_rng(0)
    for start, width in rows():
        changed = vector.clone()
        bits = changed.view(torch.int32)
        index = start + int(rng.integers(width))
        bits[index] ^= 1 << int(rng.integers(31))
        assert group_digest(changed, shape) != reference, (start, width)


# ------------------------------------------------------------------ a state forged against an additive digest

_K1, _K2, _K3 = (np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def mix(indices: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """A 64-bit multiply-xorshift mix of (canonical index, float32 bits), value by value (uint64 wraps)."""
    z = (indices.astype(np.uint64) * _K1) ^ bits.astype(np.uint64)
    z = z * _K2
    z ^= z >> np.uint64(31)
    z = z * _K3
    return z ^ (z >> np.uint64(29))


def additive_digest(vector: torch.Tensor) -> str:
    """A digest that sums its units' hashes: rows of 16 values or more by their truncated sha256, narrower ones by
    the sum of their values' 64-bit mixes in the high half, all modulo 2**128. Shard-independent, but forgeable."""
    total, values = 0, vector.numpy()
    for start, width in rows():
        row = values[start : start + width]
        if width >= 16:
            h = hashlib.sha256(start.to_bytes(8, "big") + row.tobytes()).digest()
            total += int.from_bytes(h[:16], "big")
        else:
            total += (int(mix(np.arange(start, start + width), row.view(np.uint32)).sum()) & (2**64 - 1)) << 64
    return f"{total % 2**128:032x}"


def join(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], mask: int, cap: int):
    """Pairs of entries of two lists (sums, chosen candidates) whose sums add to 0 in the bits of `mask`."""
    (sa, pa), (sb, pb) = a, b
    keys = (np.uint64(0) - sb) & np.uint64(mask)
    order = np.argsort(keys, kind="stable")
    wanted = sa & np.uint64(mask)
    lo = np.searchsorted(keys[order], wanted, "left")
    counts = np.searchsorted(keys[order], wanted, "right") - lo
    ia = np.repeat(np.arange(len(sa)), counts)
    ib = order[np.repeat(lo, counts) + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)]
    return (sa[ia] + sb[ib])[:cap], np.concatenate([pa[ia], pb[ib]], axis=1)[:cap]


def forge(vector: torch.Tensor, positions: list[int], size: int = 2**14) -> torch.Tensor:
    """`vector` with new values at 16 one-value rows whose mixes add up to the old ones' (Wagner's k-tree with 16
    lists of `size` candidates: 13 bits cancel per level, the last level the remaining 25)."""
    rng = np.random.default_rng(1)
    candidates = rng.standard_normal((len(positions), size)).astype(np.float32)
    index = np.array(positions)
    target = mix(index, vector.numpy()[index].view(np.uint32)).sum()
    lists = []
    for i, p in enumerate(positions):
        sums = mix(np.full(size, p), candidates[i].view(np.uint32))
        lists.append((sums - target if i == 0 else sums, np.arange(size)[:, None]))
    for bits in (13, 26, 39, 64):
        mask = 2**bits - 1
        lists = [join(lists[i], lists[i + 1], mask, cap=2**15) for i in range(0, len(lists), 2)]
    ((sums, picks),) = lists
    assert len(sums) and not np.any(sums[0]), "no forgery found"
    forged = vector.clone()
    forged[positions] = torch.from_numpy(candidates[np.arange(len(positions)), picks[0]])
    return forged


def test_a_state_forged_to_collide_in_a_sum_of_hashes_has_another_digest() -> None:
    """A sum of per-unit hashes modulo 2**n is forgeable: sixteen one-value rows chosen by a generalized birthday
    search (a second, within this test) leave such a digest as it was. The lattice hash tells the states apart."""
    vector = torch.randn(TOTAL)
    forged = forge(vector, list(range(NARROW, NARROW + 16)))
    assert not torch.equal(forged, vector) and bool(torch.isfinite(forged).all())
    assert additive_digest(forged) == additive_digest(vector)  # the forgery holds against the additive digest
    for shape in (Shape("FULL_SHARD", 1), Shape("FULL_SHARD", 3)):
        assert group_digest(forged, shape) != group_digest(vector, shape)

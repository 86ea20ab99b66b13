"""Digests of a worker group's outer parameters that do not depend on how the group is sharded.

Groups of any shape share one state after a round: their digests must be equal when their parameters are, whatever
their number of ranks and sharding. A sha256 of each rank's shard is not (shards differ); a sha256 of the whole
canonical vector would need it gathered on one rank. So the digest is a sum: each *unit* of the canonical vector
gets a 128-bit hash that includes where it sits, and the group's digest is the sum of all units' hashes modulo
2**128, to which each rank adds the units it owns. Any rank of any shape holds whole rows of every parameter (FSDP
cuts dim 0, ``diloco.swarm.rounds.layout``), so a unit is one row: rows of at least ``ROW_BYTES`` bytes are hashed with
sha256 (fast, one call per row), narrower ones value by value with a multiply-xorshift mix in torch (a bias, a
norm's weight: a small share of any model). Of the replicas holding a row, the one whose exchanged slice holds the
row's first value owns it, so every row counts exactly once in every group.

The digest tells states apart and proves a download whole; it is no defence against a peer that forges states.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from diloco.swarm.rounds.layout import RankLayout

ROW_BYTES = 64  # rows at least this wide get one sha256 each; narrower rows are mixed value by value
MODULUS = 2**128
_START = struct.Struct("!Q")
_MASK64 = 2**64 - 1


def _signed(constant: int) -> int:
    return constant - 2**64 if constant >= 2**63 else constant


_K1, _K2, _K3 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


class Digest(Protocol):
    """A group's digest of its outer parameters, as the sum of its ranks' parts."""

    def partial(self, values: torch.Tensor) -> Any:
        """This rank's part, from its local buffer of outer parameters."""
        ...

    def combine(self, parts: Iterable[Any]) -> str:
        """The group's digest from every rank's part, in rank order."""
        ...


class CanonicalDigest:
    """The digest of one rank's part of a group of one shape.

    :param model_shapes: every parameter's full shape, in the model's order.
    :param layout: this rank's (``diloco.swarm.rounds.layout.rank_layout``); its exchanged runs are one slice of its
        local buffer, which decides the rows it owns.
    """

    def __init__(self, model_shapes: Sequence[Sequence[int]], layout: RankLayout):
        begin = min((p.local for p in layout.exchanged), default=0)
        end = begin + layout.exchanged_numel
        # (canonical start, local start, row width, rows) of the row runs this rank owns
        self.runs: list[tuple[int, int, int, int]] = []
        bounds, offset = [], 0
        for shape in model_shapes:
            numel = math.prod(shape)
            rows = shape[0] if shape else 1
            bounds.append((offset, offset + numel, numel // rows if rows else 0))
            offset += numel
        for piece in layout.held:
            for first, last, width in bounds:
                lo, hi = max(first, piece.start), min(last, piece.stop)
                if hi <= lo or not width:
                    continue
                local = piece.local + lo - piece.start
                # rows whose first value lies in [begin, end): the replica slice this rank exchanges
                skip = max(0, -(-(begin - local) // width))
                stop_row = min((hi - lo) // width, max(0, -(-(end - local) // width)))
                if stop_row > skip:
                    self.runs.append((lo + skip * width, local + skip * width, width, stop_row - skip))

    def partial(self, values: torch.Tensor) -> int:
        """This rank's share of the group's digest, from its local buffer `values` (flat float32, CPU)."""
        flat = values.detach().reshape(-1)
        total = 0
        for start, local, width, rows in self.runs:
            run = flat[local : local + width * rows]
            if width * 4 >= ROW_BYTES:
                data = memoryview(run.contiguous().numpy()).cast("B")
                for row in range(rows):
                    h = hashlib.sha256(_START.pack(start + row * width))
                    h.update(data[row * width * 4 : (row + 1) * width * 4])
                    total += int.from_bytes(h.digest()[:16], "big")
            else:  # a 64-bit sum, moved to the high half so that splitting it over ranks changes no carry
                total += _mix_sum(run, start) << 64
        return total % MODULUS

    @staticmethod
    def combine(parts: Iterable[int]) -> str:
        """The group's digest from every rank's `partial` (any order)."""
        return f"{sum(parts) % MODULUS:032x}"


def _mix_sum(values: torch.Tensor, start: int) -> int:
    """Sum over the values of a 64-bit mix of (canonical index, float32 bits); int64 arithmetic wraps."""
    bits = values.contiguous().view(torch.int32).to(torch.int64).bitwise_and_(0xFFFFFFFF)
    z = torch.arange(start, start + values.numel(), dtype=torch.int64).mul_(_K1).bitwise_xor_(bits)
    z.mul_(_K2)
    z.bitwise_xor_(z.bitwise_right_shift(31).bitwise_and_(2**33 - 1))  # a logical shift: mask the sign's copies
    z.mul_(_K3)
    z.bitwise_xor_(z.bitwise_right_shift(29).bitwise_and_(2**35 - 1))
    return int(z.sum()) & _MASK64


class ShardDigest:
    """A digest for groups that only meet groups of their own shape (the in-memory swarm of tests and benches,
    ``diloco.outer.diloco.DiLoCo`` without a digest): sha256 over the ranks' shard digests, in rank order."""

    @staticmethod
    def partial(values: torch.Tensor) -> str:
        return hashlib.sha256(memoryview(values.detach().reshape(-1).contiguous().numpy())).hexdigest()

    @staticmethod
    def combine(parts: Iterable[str]) -> str:
        return hashlib.sha256("".join(parts).encode()).hexdigest()

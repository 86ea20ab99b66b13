"""Digests of a worker group's outer state (its outer parameters and momentum) that do not depend on how the group is
sharded.

Groups of any shape share one state after a round: their digests must be equal when their parameters are, whatever
their number of ranks and sharding. A sha256 of each rank's shard is not (shards differ); a sha256 of the whole
canonical vector would need it gathered on one rank. So the digest is homomorphic: each *unit* of the canonical
vector is hashed on its own, with where it sits, into a vector that the group adds up, each rank the units it owns.
Any rank of any shape holds whole rows of every parameter (FSDP cuts dim 0, ``diloco.swarm.rounds.layout``), so a
unit is one row (one value of a 1-D parameter). Of the replicas holding a row, the one whose exchanged slice holds
the row's first value owns it, so every row counts exactly once in every group.

The sum is LtHash (Lewi et al. 2019, "Securing update propagation with homomorphic hashing", the multiset hash
family of Bellare and Micciancio): a row's hash is sha256 over a domain tag, the canonical index of its first value
and its bytes, expanded by shake_128 to ``LANES`` 16-bit lanes; the group's lanes are the rows' added lane by lane
modulo 2**16, and its digest is the sha256 of them (64 hex characters). Finding another state with the same lanes
is a short-vector problem in a lattice of dimension ``LANES`` (about 200-bit security), where a plain sum of
128-bit hashes falls to a generalized birthday search (Wagner) in about 2**16 work per 128 rows an attacker
chooses. So equal digests prove equal states even against a source that forges them: a downloaded state is taken
only when its digest is the one its owner signed (``diloco.outer.catchup``).
Measured: 2.1 s for a 110M-value float32 state (237k rows) on 2 CPU cores, 3.4-4 s with the other core busy.
Most of it is the expansion, about 5 us a row whatever its width; a rank of a sharded group hashes only its rows.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from diloco.swarm.rounds.layout import RankLayout

LANES = 1024  # 16-bit lanes of a row's hash and of the sum (LtHash16: 2048 bytes)
DOMAIN = b"diloco outer row\0"  # keeps these row hashes apart from any other sha256 of the same bytes
BATCH_ROWS = 4096  # rows expanded before one numpy sum: 8 MiB of lanes
_INDEX = struct.Struct("!Q")
_LANE = np.dtype("<u2")  # the lanes' byte order, the same on every machine


class Digest(Protocol):
    """A group's digest of its outer parameters, as the sum of its ranks' parts."""

    def partial(self, *tensors: torch.Tensor) -> Any:
        """This rank's part, from its local buffers of the outer state: the outer parameters, then the momentum when
        there is one (a picklable object: the ranks gather it)."""
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

    def partial(self, *tensors: torch.Tensor) -> bytes:
        """This rank's share of the group's digest, from its local buffers (flat float32, CPU, all of one layout):
        the outer parameters, then the momentum when there is one, each under a domain of its own. The sum of their
        rows' lanes, ``2 * LANES`` bytes."""
        total = np.zeros(LANES, dtype=_LANE)
        expanded: list[bytes] = []
        for which, values in enumerate(tensors):
            flat = values.detach().reshape(-1).contiguous()
            data = memoryview(flat.numpy()).cast("B")
            size = flat.element_size()
            domain = DOMAIN + bytes([which])  # a momentum row never hashes like a parameter row of the same bytes
            for start, local, width, rows in self.runs:
                row_bytes = width * size
                at = local * size
                for row in range(rows):  # sha256 reads the row (several times faster a byte than shake_128 here)
                    key = hashlib.sha256(domain + _INDEX.pack(start + row * width))
                    key.update(data[at : at + row_bytes])
                    expanded.append(hashlib.shake_128(key.digest()).digest(2 * LANES))
                    at += row_bytes
                    if len(expanded) == BATCH_ROWS:
                        total += _lane_sum(expanded)
                        expanded.clear()
        if expanded:
            total += _lane_sum(expanded)
        return total.tobytes()

    @staticmethod
    def combine(parts: Iterable[bytes]) -> str:
        """The group's digest from every rank's `partial` (any order): sha256 of their lanes' sum, hex."""
        total = np.zeros(LANES, dtype=_LANE)
        for part in parts:
            total += np.frombuffer(part, dtype=_LANE, count=LANES)
        return hashlib.sha256(total.tobytes()).hexdigest()


def _lane_sum(expanded: list[bytes]) -> np.ndarray:
    """The lane-wise sum modulo 2**16 of rows' expanded hashes (uint16 arithmetic wraps)."""
    return np.frombuffer(b"".join(expanded), dtype=_LANE).reshape(-1, LANES).sum(axis=0, dtype=_LANE)


class ShardDigest:
    """A digest for groups that only meet groups of their own shape (the in-memory swarm of tests and benches,
    ``diloco.outer.diloco.DiLoCo`` without a digest): sha256 over the ranks' shard digests, in rank order."""

    @staticmethod
    def partial(*tensors: torch.Tensor) -> str:
        digest = hashlib.sha256()
        for values in tensors:
            digest.update(memoryview(values.detach().reshape(-1).contiguous().numpy()).cast("B"))
        return digest.hexdigest()

    @staticmethod
    def combine(parts: Iterable[str]) -> str:
        return hashlib.sha256("".join(parts).encode()).hexdigest()

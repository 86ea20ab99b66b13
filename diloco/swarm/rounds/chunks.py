"""The chunks of the canonical vector that sparse rounds select from (``diloco.swarm.rounds.sparse``).

A chunk is a run of one row of a matrix (a parameter of two or more dimensions, its rows along dim 0): a row of
``CHUNK`` values or fewer is one chunk, a longer one is cut every ``CHUNK`` values. FSDP shards dim 0 by whole
rows, so no chunk ever straddles two ranks' shards, whatever the group's shape: every group selects the same
coordinates from the same values. Parameters of fewer dimensions (norms, biases: about 0.1% of a transformer) are
*dense*: FSDP cuts them anywhere, and they travel whole.

Every round cut (``diloco.swarm.rounds.layout``) of a sparse round falls on a chunk boundary (``floor``/``ceil``);
any position inside a dense parameter is one.

Plain Python and numpy over shapes; no torch.distributed, no network.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np

CHUNK = 4096  # values per chunk at most (SparseLoCo's)


class Chunks:
    """The chunk boundaries of a model's canonical vector, from its parameters' shapes (in model order)."""

    def __init__(self, shapes: Sequence[Sequence[int]]):
        self.starts: list[int] = []
        self.rows: list[int] = []  # values per row; 0: a dense parameter
        offset = 0
        for shape in shapes:
            numel = math.prod(shape)
            if numel == 0:
                continue
            self.starts.append(offset)
            self.rows.append(numel // shape[0] if len(shape) >= 2 else 0)
            offset += numel
        self.total = offset

    def _param(self, pos: int) -> int:
        return bisect.bisect_right(self.starts, pos) - 1

    def floor(self, pos: int) -> int:
        """The last boundary at or before `pos` (0 <= pos <= total)."""
        if not 0 <= pos <= self.total:
            raise ValueError(f"position {pos} outside a vector of {self.total}")
        if pos == self.total:
            return pos
        i = self._param(pos)
        row = self.rows[i]
        if not row:
            return pos
        start = self.starts[i]
        within = (pos - start) % row
        return pos - within + within // CHUNK * CHUNK

    def ceil(self, pos: int) -> int:
        """The first boundary at or after `pos`."""
        low = self.floor(pos)
        if low == pos:
            return pos
        i = self._param(pos)
        row, start = self.rows[i], self.starts[i]
        row_start = start + (pos - start) // row * row
        return min(row_start + row, low + CHUNK)

    def is_boundary(self, pos: int) -> bool:
        return self.floor(pos) == pos

    def runs(self, start: int, stop: int, most: int) -> list[tuple[int, int]]:
        """``[start, stop)`` (both boundaries) in runs of at most `most` values that begin and end on boundaries
        (a chunk longer than `most` is one run)."""
        runs = []
        while start < stop:
            end = self.floor(min(start + most, stop))
            if end <= start:
                end = self.ceil(start + 1)
            runs.append((start, end))
            start = end
        return runs

    def within(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The chunks of ``[start, stop)`` (both boundaries): (their starts, their lengths), relative to `start`
        and in order, and a boolean mask of the positions in dense parameters."""
        if not (self.is_boundary(start) and self.is_boundary(stop)) or stop < start:
            raise ValueError(f"[{start}, {stop}) does not begin and end on chunk boundaries")
        starts, lengths = [], []
        dense = np.zeros(stop - start, dtype=bool)
        i = max(0, self._param(start))
        while i < len(self.starts) and self.starts[i] < stop:
            a = self.starts[i]
            b = self.starts[i + 1] if i + 1 < len(self.starts) else self.total
            lo, hi = max(a, start), min(b, stop)
            if hi > lo:
                row = self.rows[i]
                if not row:
                    dense[lo - start : hi - start] = True
                else:
                    first, last = (lo - a) // row, (hi - a - 1) // row
                    per_row = np.arange(0, row, CHUNK)
                    grid = (np.arange(first, last + 1)[:, None] * row + per_row[None, :]).reshape(-1) + a
                    length = np.minimum(CHUNK, row - per_row)
                    lens = np.broadcast_to(length, (last - first + 1, per_row.size)).reshape(-1)
                    keep = (grid >= lo) & (grid < hi)
                    starts.append(grid[keep] - start)
                    lengths.append(lens[keep])
            i += 1
        if not starts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), dense
        return np.concatenate(starts).astype(np.int64), np.concatenate(lengths).astype(np.int64), dense

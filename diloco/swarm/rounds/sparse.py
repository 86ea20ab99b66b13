"""Sparse rounds (``--hv.compression sparse``): per chunk, the k largest values by magnitude, quantized to a few bits
(SparseLoCo, arXiv 2508.15706).

**Selection.** Per chunk of the canonical vector (``diloco.swarm.rounds.chunks``: a row of a matrix, cut every 4096
values), the k = max(1, round(density x length)) values of largest magnitude. Dense parameters (norms, biases)
travel whole, in float32.

**Values.** Per chunk a scale s = (largest selected magnitude) / 2^(b-1), rounded to bfloat16 (float32's range in
2 bytes: a row of 64 values pays 16 bits for it, not 32); each selected value is sent as its sign and a magnitude m
in 1..2^(b-1), decoding to ±m·s (b bits: 2 by default, 4 or 8). Each is within s/2 of itself (and of the scale's
rounding), except those under s/2, which become ±s. What is not sent (the
rest of the chunk and the rounding) is the sender's to keep: the outer loop's error feedback
(``diloco.outer.error_feedback``) adds it to the next round's values.

**Positions.** Within a chunk, the selected offsets ascend; each gap (offsets skipped) is Golomb-Rice coded with
r = floor(log2(length / k)) low bits, fixed width, and its high part in unary: about r + 2 bits a position (7.6 at
64 of 4096) against 12 for plain 12-bit offsets (``position_bits`` measures both).

A part's message: the byte count of its unary stream (u32), the dense values (float32), the chunks' scales
(bfloat16), the values' codes (b bits each), the low bits of the gaps, the unary stream. The decoder knows the
part's chunks from the model's shapes, so it knows every count but the last, and refuses a message of any other
length, or whose offsets leave their chunk.

**Rounds.** A reducer does not re-encode the mean of the sparse contributions (the union of their positions, in a
format of its own) but relays them: the contributions it kept, each with its weight, as one message that every
holder decodes and averages alike, in the same order and the same float32 operations, so every group applies the
same update. Measured in ``diloco bench compression``: with 2 or 3 groups the relay is smaller than the union at
float16 (a union position costs its offset and 16 bits; a relayed one its offset and b bits) and adds no second
rounding.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from diloco.swarm.rounds import tcp
from diloco.swarm.rounds.chunks import Chunks

BITS = (2, 4, 8)
_U32 = struct.Struct("!I")
_ENTRY = struct.Struct("!dI")  # a relayed contribution: its weight, its byte count


def chunk_k(lengths: np.ndarray, density: float) -> np.ndarray:
    """Values a chunk of each length sends: max(1, round(density x length)), at most its length."""
    return np.minimum(lengths, np.maximum(1, np.rint(lengths * density))).astype(np.int64)


def rice_bits(lengths: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The Golomb-Rice parameter of each chunk: floor(log2(length / k))."""
    ratio = np.maximum(1, lengths // np.maximum(k, 1))
    return np.floor(np.log2(ratio)).astype(np.int64)


def _pack(values: np.ndarray, widths: np.ndarray) -> bytes:
    """`values` (non-negative, each below 2^its width), most significant bit first, back to back."""
    if values.size == 0:
        return b""
    top = int(widths.max(initial=0))
    if top == 0:
        return b""
    bits = (values[:, None] >> np.arange(top - 1, -1, -1)) & 1
    keep = np.arange(top)[None, :] >= (top - widths)[:, None]
    return np.packbits(bits[keep].astype(np.uint8)).tobytes()


def _unpack(data: memoryview, widths: np.ndarray) -> np.ndarray:
    top = int(widths.max(initial=0))
    if widths.size == 0 or top == 0:
        return np.zeros(widths.size, np.int64)
    stream = np.unpackbits(np.frombuffer(data, np.uint8))[: int(widths.sum())]
    padded = np.zeros((widths.size, top), np.int64)
    padded[np.arange(top)[None, :] >= (top - widths)[:, None]] = stream
    return padded @ (1 << np.arange(top - 1, -1, -1))


def _bytes(bits: int) -> int:
    return -(-bits // 8)


@dataclass(frozen=True)
class Selection:
    """A part's chunks and how many values each sends (what encoder and decoder both derive from the shapes)."""

    starts: np.ndarray
    lengths: np.ndarray
    k: np.ndarray
    rice: np.ndarray
    dense: np.ndarray  # mask of the part's positions in dense parameters

    @property
    def values(self) -> int:
        return int(self.k.sum())


class SparseCodec:
    """The sparse wire format of one model (its shapes) at one density and value width."""

    def __init__(self, chunks: Chunks, density: float, bits: int):
        if not 0 < density <= 1 or bits not in BITS:
            raise ValueError(f"density {density} (0 < d <= 1) and bits {bits} ({BITS})")
        self.chunks, self.density, self.bits = chunks, density, bits
        self.top = 1 << (bits - 1)

    def selection(self, start: int, n: int) -> Selection:
        starts, lengths, dense = self.chunks.within(start, start + n)
        k = chunk_k(lengths, self.density)
        return Selection(starts, lengths, k, rice_bits(lengths, k), dense)

    # ------------------------------------------------------------------------------------------ one contribution

    def encode(self, part: torch.Tensor, start: int) -> bytes:
        """The part's message (see the module); non-finite values make their chunk decode to NaN."""
        x = part.detach().reshape(-1).to(torch.float32).numpy()
        sel = self.selection(start, x.size)
        offsets, values, scale16, level = self._quantize(x, sel)
        first = np.cumsum(sel.k) - sel.k  # each chunk's first value
        codes = ((values < 0).astype(np.int64) << (self.bits - 1)) | (level - 1)
        gaps = offsets.copy()
        if gaps.size:
            gaps[1:] -= offsets[:-1] + 1
            gaps[first] = offsets[first]  # (every chunk sends one value at least)
        widths = np.repeat(sel.rice, sel.k)
        low, high = gaps & ((1 << widths) - 1), gaps >> widths
        unary = np.zeros(int((high + 1).sum()), np.uint8)
        unary[np.cumsum(high + 1) - 1] = 1
        unary_bytes = np.packbits(unary).tobytes()
        return b"".join((
            _U32.pack(len(unary_bytes)), x[sel.dense].tobytes(), scale16.view(torch.int16).numpy().tobytes(),
            _pack(codes, np.full(codes.size, self.bits)), _pack(low, widths), unary_bytes,
        ))  # fmt: skip

    def _quantize(self, x: np.ndarray, sel: Selection) -> tuple[np.ndarray, np.ndarray, torch.Tensor, np.ndarray]:
        """(offsets, values, each chunk's bfloat16 scale, each value's magnitude level 1..2^(b-1))."""
        offsets, values, absmax = self._select(x, sel)
        chunk_of = np.repeat(np.arange(sel.k.size), sel.k)
        scale16 = torch.from_numpy(absmax / np.float32(self.top)).to(torch.bfloat16)
        with np.errstate(invalid="ignore", divide="ignore"):
            level = np.rint(np.abs(values) / scale16.float().numpy()[chunk_of])
        return offsets, values, scale16, np.clip(np.nan_to_num(level, nan=1.0, posinf=1.0), 1, self.top).astype(
            np.int64)  # fmt: skip

    def carry(self, part: torch.Tensor, start: int) -> torch.Tensor:
        """decode(encode(part)), without the bits in between: what a round carries of these values."""
        x = part.detach().reshape(-1).to(torch.float32).numpy()
        sel = self.selection(start, x.size)
        offsets, values, scale16, level = self._quantize(x, sel)
        out = self._values(x.size, sel, offsets, values < 0, level, scale16)
        out[torch.from_numpy(sel.dense)] = torch.from_numpy(x[sel.dense])
        return out

    @staticmethod
    def _values(n: int, sel: Selection, offsets: np.ndarray, negative: np.ndarray, level: np.ndarray,
                scale16: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The dense values of a part: its dense values are set by the caller; the selected ones ±level·scale."""
        out = np.zeros(n, np.float32)
        scale = scale16.float().numpy()[np.repeat(np.arange(sel.k.size), sel.k)]
        value = level.astype(np.float32) * scale
        value = np.where(negative, -value, value)
        value[~np.isfinite(scale)] = np.nan
        out[np.repeat(sel.starts, sel.k) + offsets] = value
        return torch.from_numpy(out)

    def _select(self, x: np.ndarray, sel: Selection) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offsets within their chunk, ascending per chunk; the values there), chunk after chunk, and each chunk's
        largest magnitude (NaN where a selected value is NaN: it counts as the largest)."""
        total = sel.values
        offsets, values = np.zeros(total, np.int64), np.zeros(total, np.float32)
        absmax = np.zeros(sel.k.size, np.float32)
        first = np.cumsum(sel.k) - sel.k
        for length in np.unique(sel.lengths):
            which = np.flatnonzero(sel.lengths == length)
            k = int(sel.k[which[0]])
            block = torch.from_numpy(x[sel.starts[which][:, None] + np.arange(length)])
            largest = torch.topk(block.abs(), k, dim=1, sorted=False)
            top = largest.indices.sort(dim=1).values
            place = first[which][:, None] + np.arange(k)
            offsets[place] = top.numpy()
            values[place] = torch.gather(block, 1, top).numpy()
            absmax[which] = largest.values.amax(dim=1).numpy()
        return offsets, values, absmax

    def decode(self, data: memoryview, n: int, start: int) -> torch.Tensor:
        """n float32 values of `encode`'s bytes; ValueError naming what does not fit."""
        sel = self.selection(start, n)
        dense, chunks, count = int(sel.dense.sum()), sel.k.size, sel.values
        widths = np.repeat(sel.rice, sel.k)
        code_bytes, low_bytes = _bytes(count * self.bits), _bytes(int(widths.sum()))
        if data.nbytes < 4:
            raise ValueError(f"a sparse part of {data.nbytes} bytes")
        unary_bytes = _U32.unpack(data[:4])[0]
        fixed = 4 + 4 * dense + 2 * chunks + code_bytes + low_bytes
        if data.nbytes != fixed + unary_bytes:
            raise ValueError(f"{data.nbytes} bytes of sparse for {n} values ({fixed} + {unary_bytes} expected)")
        at = 4
        dense_values = np.frombuffer(data, np.float32, dense, at)
        at += 4 * dense
        scale16 = torch.from_numpy(np.frombuffer(data, np.int16, chunks, at).copy()).view(torch.bfloat16)
        at += 2 * chunks
        codes = _unpack(data[at : at + code_bytes], np.full(count, self.bits))
        at += code_bytes
        low = _unpack(data[at : at + low_bytes], widths)
        at += low_bytes
        unary = np.unpackbits(np.frombuffer(data, np.uint8, unary_bytes, at))
        ends = np.flatnonzero(unary)
        if ends.size != count or (count and ends[-1] < unary.size - 8):
            raise ValueError(f"a sparse part's positions: {ends.size} of {count}, or trailing bits")
        high = np.diff(ends, prepend=-1) - 1
        total = np.cumsum(((high << widths) | low) + 1)
        first = np.cumsum(sel.k) - sel.k
        before = np.where(first > 0, total[np.maximum(first - 1, 0)], 0) if count else first
        offsets = total - np.repeat(before, sel.k) - 1
        if count and np.any(offsets[first + sel.k - 1] >= sel.lengths):
            raise ValueError("a sparse part's offset beyond its chunk")
        negative = codes >> (self.bits - 1) == 1
        out = self._values(n, sel, offsets, negative, (codes & (self.top - 1)) + 1, scale16)
        out[torch.from_numpy(sel.dense)] = torch.from_numpy(dense_values.copy())
        return out

    def max_bytes(self, n: int) -> int:
        return 16 + 6 * n

    # ------------------------------------------------------------------------------- a reducer's relayed contributions

    @staticmethod
    def relay(contributions: Sequence[tuple[object, float]]) -> bytes:
        """The contributions a reducer kept (their messages, in sender order) and their weights, as one message."""
        header = [_U32.pack(len(contributions))]
        header += [_ENTRY.pack(weight, memoryview(data).nbytes) for data, weight in contributions]
        return b"".join(header + [bytes(memoryview(data).cast("B")) for data, _ in contributions])

    def decode_relay(self, data: memoryview, n: int, start: int, max_senders: int) -> torch.Tensor:
        """The weighted mean of a relay's contributions (NaN when it holds none), computed alike by every holder."""
        if data.nbytes < 4:
            raise ValueError(f"a relay of {data.nbytes} bytes")
        count = _U32.unpack(data[:4])[0]
        if count > max_senders:
            raise ValueError(f"a relay of {count} contributions, at most {max_senders} expected")
        at = 4 + count * _ENTRY.size
        if data.nbytes < at:
            raise ValueError(f"a relay of {data.nbytes} bytes for {count} contributions")
        entries = [_ENTRY.unpack(data[4 + i * _ENTRY.size : 4 + (i + 1) * _ENTRY.size]) for i in range(count)]
        if at + sum(length for _, length in entries) != data.nbytes:
            raise ValueError("a relay whose contributions do not add up to its length")
        if count == 0:
            return torch.full((n,), float("nan"))
        mean, total = torch.zeros(n), 0.0
        for weight, length in entries:
            if not weight >= 0 or weight == float("inf"):
                raise ValueError(f"a relayed weight of {weight}")
            mean.add_(self.decode(data[at : at + length], n, start).mul_(weight))  # two roundings, never fused
            total += weight
            at += length
        return mean.div_(total)

    def relay_max_bytes(self, n: int, senders: int) -> int:
        return 4 + senders * (_ENTRY.size + self.max_bytes(n))

    def tcp_codec(self) -> tcp.Codec:
        """This format as the rounds' codec."""
        return tcp.Codec(
            "sparse", tcp.RAW.part_numel, encode=self.encode, decode=self.decode, max_bytes=self.max_bytes,
            chunks=self.chunks, relay=self.relay, decode_relay=self.decode_relay, relay_max_bytes=self.relay_max_bytes,
            carry=self.carry,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------------ measures

    def sizes(self, part: torch.Tensor, start: int) -> dict[str, int]:
        """Bytes of a part's message by section, and the bytes its positions would take as plain offsets of
        ceil(log2 length) bits (``plain_positions``) against Golomb-Rice (``positions``)."""
        encoded = memoryview(self.encode(part, start))
        sel = self.selection(start, part.numel())
        unary = _U32.unpack(encoded[:4])[0]
        low = _bytes(int(np.repeat(sel.rice, sel.k).sum()))
        plain = int((sel.k * np.ceil(np.log2(np.maximum(sel.lengths, 2)))).sum())
        return {"total": encoded.nbytes, "dense": 4 * int(sel.dense.sum()), "scales": 2 * sel.k.size,
                "values": _bytes(sel.values * self.bits), "positions": low + unary, "plain_positions": _bytes(plain),
                "selected": sel.values}


def image(codec: tcp.Codec, values: torch.Tensor, start: int) -> torch.Tensor:
    """What a round carries of `values` (canonical ``[start, start + n)``, whole chunks): decode(encode(values)),
    part by part as the rounds cut them."""
    assert codec.chunks is not None and codec.carry is not None, "a codec of whole chunks"
    out = torch.empty(values.numel())
    for lo, hi in codec.chunks.runs(start, start + values.numel(), codec.part_numel):
        out[lo - start : hi - start] = codec.carry(values[lo - start : hi - start], lo)
    return out

"""Wire formats of the pseudo-gradient: each ``--hv.compression`` name, as the rounds' codec
(``diloco.swarm.rounds.tcp.Codec``, on both transports) and as hivemind's (the rank-by-rank averager's parts over
libp2p), in one registry.

Both encode the same values the same way, so a round's result does not depend on what carried it. ``int4`` has no
hivemind codec: it travels only in rounds of whole groups, which is how the trainer averages.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from google.protobuf.message import DecodeError
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Uniform8BitQuantization,
)
from hivemind.proto import runtime_pb2

from diloco.swarm.rounds import tcp

if TYPE_CHECKING:
    from diloco.config import HvConfig


class Uniform8Bit(Uniform8BitQuantization):
    """hivemind's ``Uniform8BitQuantization`` (per part: 256 levels over mean +- 3 sigma, codebook = bucket means)
    with a decoder that works on numpy 2.4 (installed here): hivemind 1.1.12 calls ``int()`` on a 1-element array,
    which numpy 2.4 rejects, so stock 8-bit all-reduce loses every remote part (peers silently keep their own
    values there). Same wire format as stock. Lower error and ~20x faster than ``Quantile8BitQuantization``, and
    no bitsandbytes needed."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        """The tensor a part describes; ValueError naming what is wrong when its header and buffer disagree (a
        codebook longer than 256 levels or than the buffer, indices beyond the codebook, a size that is not the
        number of indices, a dtype that is no float): a peer's message, checked before anything is allocated."""
        buffer = serialized_tensor.buffer
        if len(buffer) < 8:
            raise ValueError(f"an int8 buffer of {len(buffer)} bytes: no codebook length")
        codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        itemsize = np.dtype(self.codebook_dtype).itemsize
        if not 0 < codebook_size <= self.n_bins or 8 + codebook_size * itemsize > len(buffer):
            raise ValueError(f"an int8 codebook of {codebook_size} levels in {len(buffer)} bytes")
        codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        indices = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        size = tuple(serialized_tensor.size)
        if any(d < 0 for d in size) or math.prod(size) != indices.size:
            raise ValueError(f"an int8 part of size {list(size)} with {indices.size} indices")
        if indices.size and int(indices.max()) >= codebook_size:
            raise ValueError(f"int8 index {int(indices.max())} beyond a codebook of {codebook_size} levels")
        dtype = getattr(torch, serialized_tensor.dtype, None) if serialized_tensor.dtype in FLOATS else None
        if dtype is None:
            raise ValueError(f"an int8 part of dtype {serialized_tensor.dtype[:32]!r}")
        # copies: torch warns on (and must never write to) a read-only view of the received buffer
        values = torch.from_numpy(codebook.copy())[torch.from_numpy(indices.astype(np.int64))]
        return values.to(dtype).reshape(size).requires_grad_(serialized_tensor.requires_grad)


FLOATS = ("float32", "float16", "bfloat16", "float64")  # the dtypes hivemind's 8-bit parts may claim


def decode_int8(quantizer: Uniform8Bit, data: memoryview, n: int) -> torch.Tensor:
    """A round's int8 part: exactly n float32 values without grad, else ValueError naming what the header claims
    (parts are float32 vectors, so any other dtype, shape or a gradient is the sender's error, not this reducer's)."""
    try:
        message = runtime_pb2.Tensor.FromString(bytes(data))
    except DecodeError as e:
        raise ValueError(f"not an int8 part: {e}") from None
    if message.compression != quantizer.compression_type:
        raise ValueError(f"an int8 part compressed as {message.compression}")
    if message.dtype != "float32" or list(message.size) != [n] or message.requires_grad:
        raise ValueError(f"an int8 part of dtype {message.dtype[:32]!r}, size {list(message.size)[:4]}, "
                         f"requires_grad {message.requires_grad}: float32 [{n}] without grad expected")  # fmt: skip
    return quantizer.extract(message)


@dataclass(frozen=True)
class WireFormat:
    """One compression name on both transports.

    :param hivemind: the codec of parts and averages over hivemind's libp2p all-reduce (its ``compression=``);
        None: the format exists only for rounds of whole groups.
    :param tcp: the same format in the rounds of ``diloco.swarm.rounds.tcp``.
    """

    name: str
    hivemind: CompressionBase | None
    tcp: tcp.Codec


INT4_BLOCK = 64  # values per scale: a value far larger than the rest costs precision only in its own block
INT4_LEVELS = 7  # -7..7 times the block's scale (absmax / 7), stored as 1..15 in a nibble


def _blocks(n: int) -> int:
    return -(-n // INT4_BLOCK)


def encode_int4(part: torch.Tensor) -> memoryview:
    """Per block of ``INT4_BLOCK`` values: its float32 scale (absmax / 7), then the values rounded to -7..7 times it,
    two per byte (high nibble first). All scales come first, then all nibbles. A non-finite value makes its block's
    decoded values NaN, so screening rejects the part as it would the original."""
    blocks = part.new_zeros(_blocks(part.numel()) * INT4_BLOCK)
    blocks[: part.numel()] = part
    blocks = blocks.view(-1, INT4_BLOCK)
    scale = blocks.abs().amax(dim=1) / INT4_LEVELS
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: zeros, not 0/0
    levels = torch.round(blocks / divisor[:, None]).clamp_(-INT4_LEVELS, INT4_LEVELS)
    nibbles = (levels + 8).to(torch.uint8)  # NaN becomes some nibble: the scale (NaN or inf) still marks the block
    packed = (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]
    encoded = torch.empty(scale.numel() * 4 + packed.numel(), dtype=torch.uint8)  # writable: decoded in place
    encoded[: scale.numel() * 4] = scale.view(torch.uint8)
    encoded[scale.numel() * 4 :] = packed.view(-1)
    return memoryview(encoded.numpy()).cast("B")


def decode_int4(data: memoryview, n: int) -> torch.Tensor:
    """n float32 values of ``encode_int4``'s bytes; ValueError when there are not exactly as many bytes as they take."""
    blocks = _blocks(n)
    if data.nbytes != blocks * (4 + INT4_BLOCK // 2) or n < 1:
        raise ValueError(f"{data.nbytes} bytes of int4 for {n} values")
    scale = torch.frombuffer(data, dtype=torch.float32, count=blocks)
    packed = torch.frombuffer(data, dtype=torch.uint8, offset=4 * blocks).view(blocks, INT4_BLOCK // 2)
    nibbles = torch.stack((packed >> 4, packed & 15), dim=2).view(blocks, INT4_BLOCK)
    values = (nibbles.to(torch.float32) - 8) * scale[:, None]
    values[~torch.isfinite(scale)] = float("nan")  # inf × 0 is NaN already; inf × 3 is not
    return values.view(-1)[:n]


INT4 = tcp.Codec(
    "int4", 2**18, encode=encode_int4, decode=decode_int4, max_bytes=lambda n: _blocks(n) * (4 + INT4_BLOCK // 2)
)


def _int8() -> WireFormat:
    quantizer = Uniform8Bit()
    codec = tcp.Codec(
        "int8",
        2**17,  # 512 KiB of float32 per codebook, as over libp2p
        encode=lambda part: quantizer.compress(part, CompressionInfo.from_tensor(part)).SerializeToString(),
        decode=lambda data, n: decode_int8(quantizer, data, n),
        max_bytes=lambda n: 4 * n + 4096,
    )
    return WireFormat("int8", quantizer, codec)


def exact(codec: tcp.Codec, bytes_per_value: int) -> tcp.Codec:
    """`codec` (a plain array of `bytes_per_value`-byte values) refusing a message of any other length than n values
    (its own decoder reads the first n and ignores the rest)."""

    def decode(data: memoryview, n: int) -> torch.Tensor:
        if data.nbytes != n * bytes_per_value or n < 1:
            raise ValueError(f"{data.nbytes} bytes of {codec.name} for {n} values")
        return codec.decode(data, n)

    return dataclasses.replace(codec, decode=decode)


WIRE_FORMATS: dict[str, WireFormat] = {
    "none": WireFormat("none", NoCompression(), exact(tcp.RAW, 4)),  # exact float32
    "fp16": WireFormat("fp16", Float16Compression(), exact(tcp.FP16, 2)),
    "int8": _int8(),
    "int4": WireFormat("int4", None, INT4),  # 4.5 bits per value: 7.1x fewer bytes than float32
}


def rounds_codec(hv: HvConfig) -> tcp.Codec | Callable[[Sequence[Sequence[int]]], tcp.Codec]:
    """The rounds' codec of ``--hv.compression``; sparse: a codec per vector of parameter shapes (it knows their
    chunks), made once per shapes."""
    if hv.compression != "sparse":
        return WIRE_FORMATS[hv.compression].tcp
    return _SparseCodecs(hv.sparse_density, hv.sparse_bits)


class _SparseCodecs:
    """Sparse codecs by parameter shapes, made once each."""

    def __init__(self, density: float, bits: int):
        self.density, self.bits = density, bits
        self._made: dict[tuple, tcp.Codec] = {}

    def __call__(self, shapes: Sequence[Sequence[int]]) -> tcp.Codec:
        key = tuple(tuple(s) for s in shapes)
        if key not in self._made:
            self._made[key] = sparse_codec(key, self.density, self.bits)
        return self._made[key]


def sparse_codec(shapes: Sequence[Sequence[int]], density: float, bits: int) -> tcp.Codec:
    """The sparse format of a vector of these parameters' shapes; its name (in every connection's hello) tells
    settings apart, so groups of another density or width refuse each other instead of misreading."""
    from diloco.swarm.rounds.chunks import Chunks
    from diloco.swarm.rounds.sparse import SparseCodec

    codec = SparseCodec(Chunks(shapes), density, bits).tcp_codec()
    tag = hashlib.sha256(f"{density!r}/{bits}".encode()).hexdigest()[:5]
    return dataclasses.replace(codec, name=f"sp{bits}{tag}")

"""How a round's parts and averages travel: ``Codec``, one per wire format, and the two exact ones (float32 and
float16). ``diloco.swarm.rounds.codecs`` builds the others and maps each ``--hv.compression`` name to its codec;
``diloco.swarm.rounds.tcp`` moves the bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from diloco.swarm.rounds.chunks import Chunks
from diloco.swarm.rounds.frames import bytes_of


@dataclass(frozen=True)
class Codec:
    """How parts and averages travel.

    :param name: at most 8 ASCII characters; both ends of a connection must use the same codec.
    :param part_numel: float32 values per part (the last part of the vector may be shorter).
    :param encode: float32 part -> bytes-like object (it may alias the part's memory).
    :param decode: (bytes-like, number of values) -> float32 tensor (it may alias the bytes).
    :param max_bytes: the largest encoding of a part of n values; longer messages are refused.
    :param raw: the encoding is the float32 values themselves: averages are received straight into the output.
    :param chunks: a codec of whole chunks (``diloco.swarm.rounds.sparse``): every part begins and ends on a boundary
        of these chunks, `encode` and `decode` take the part's canonical start as their last argument, and a reducer
        relays the contributions it kept (`relay`: [(message, weight)] -> message) instead of encoding their mean;
        every holder averages them alike (`decode_relay`: (message, n, start, senders) -> float32 tensor, at most
        `relay_max_bytes(n, senders)` bytes).
    """

    name: str
    part_numel: int
    encode: Callable[..., object]
    decode: Callable[..., torch.Tensor]
    max_bytes: Callable[[int], int]
    raw: bool = False
    chunks: Chunks | None = None
    relay: Callable[[Sequence[tuple[object, float]]], object] | None = None
    decode_relay: Callable[[memoryview, int, int, int], torch.Tensor] | None = None
    relay_max_bytes: Callable[[int, int], int] | None = None
    carry: Callable[[torch.Tensor, int], torch.Tensor] | None = None  # decode(encode(part, start)), computed directly

    def encode_part(self, values: torch.Tensor, start: int) -> object:
        """`values`, the part at canonical `start`, encoded (a codec of whole chunks takes the start)."""
        return self.encode(values) if self.chunks is None else self.encode(values, start)

    def decode_part(self, data: memoryview, n: int, start: int) -> torch.Tensor:
        return self.decode(data, n) if self.chunks is None else self.decode(data, n, start)

    def decode_average(self, data: memoryview, n: int, start: int, senders: int) -> torch.Tensor:
        """A reducer's average of a part: its encoding, or the contributions it relayed, averaged."""
        if self.decode_relay is None:
            return self.decode_part(data, n, start)
        return self.decode_relay(data, n, start, senders)

    def average_max_bytes(self, n: int, senders: int) -> int:
        return self.max_bytes(n) if self.relay_max_bytes is None else self.relay_max_bytes(n, senders)


FP16_MAX = 65504.0

RAW = Codec(
    "none", 2**18, encode=bytes_of, decode=lambda data, n: torch.frombuffer(data, dtype=torch.float32, count=n),
    max_bytes=lambda n: 4 * n, raw=True,
)  # fmt: skip
FP16 = Codec(
    "fp16", 2**18, encode=lambda part: bytes_of(part.clamp(-FP16_MAX, FP16_MAX).half()),
    decode=lambda data, n: torch.frombuffer(data, dtype=torch.float16, count=n).float(), max_bytes=lambda n: 2 * n,
)  # fmt: skip

"""The wire formats on their own (`diloco.swarm.rounds.codecs`): int4's blocks, bounds, bytes and refusals."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from diloco.swarm.rounds.codecs import (
    INT4,
    INT4_BLOCK,
    WIRE_FORMATS,
    Uniform8Bit,
    decode_int4,
    encode_int4,
)


def roundtrip(values: torch.Tensor) -> torch.Tensor:
    encoded = encode_int4(values)
    assert encoded.nbytes <= INT4.max_bytes(values.numel())
    return decode_int4(encoded, values.numel())


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 2**18])
def test_int4_error_is_at_most_half_a_level_of_each_block_and_bytes_are_4_5_bits(n: int):
    values = torch.randn(n, generator=torch.Generator().manual_seed(n)) * torch.linspace(0.01, 10, n)
    decoded = roundtrip(values)
    assert decoded.shape == values.shape and decoded.dtype == torch.float32
    blocks = -(-n // INT4_BLOCK)
    padded = torch.zeros(blocks * INT4_BLOCK)
    padded[:n] = values
    half_level = padded.view(blocks, INT4_BLOCK).abs().amax(dim=1) / 7 / 2
    error = torch.zeros(blocks * INT4_BLOCK)
    error[:n] = (decoded - values).abs()
    assert bool((error.view(blocks, INT4_BLOCK) <= half_level[:, None] * (1 + 1e-6) + 1e-12).all())
    assert encode_int4(values).nbytes == blocks * (4 + INT4_BLOCK // 2)  # 4.5 bits a value, rounded to blocks
    # each block's largest value comes back exactly (it is 7 levels of its scale), up to the scale's rounding
    assert float((decoded.abs().max() - values.abs().max()).abs()) <= 1e-5 * float(values.abs().max())


def test_int4_is_deterministic_and_keeps_zeros_and_signs():
    values = torch.tensor([0.0, -1.0, 1.0, 0.5, -0.25] + [0.0] * 100)
    assert bytes(encode_int4(values)) == bytes(encode_int4(values.clone()))
    decoded = roundtrip(values)
    assert torch.equal(torch.sign(decoded[:3]), torch.sign(values[:3])) and bool((decoded[5:] == 0).all())
    assert torch.equal(roundtrip(torch.zeros(70)), torch.zeros(70))  # an all-zero block is zeros, not 0/0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_int4_a_non_finite_value_makes_its_block_nan_and_leaves_the_others(bad: float):
    values = torch.randn(3 * INT4_BLOCK)
    values[INT4_BLOCK + 5] = bad
    decoded = roundtrip(values)
    assert bool(decoded[INT4_BLOCK : 2 * INT4_BLOCK].isnan().all())  # screening then rejects the part
    assert bool(decoded[:INT4_BLOCK].isfinite().all() and decoded[2 * INT4_BLOCK :].isfinite().all())


def test_int4_refuses_a_message_of_the_wrong_length():
    encoded = bytes(encode_int4(torch.randn(100)))
    for wrong in (encoded[:-1], encoded + b"\0", b""):
        with pytest.raises(ValueError, match="bytes of int4 for 100 values"):
            decode_int4(memoryview(bytearray(wrong)), 100)


def test_int4_exists_only_for_rounds_of_whole_groups():
    from diloco.bench.averager import SwarmAverager

    assert WIRE_FORMATS["int4"].hivemind is None and WIRE_FORMATS["int4"].tcp is INT4
    with pytest.raises(ValueError, match="only in rounds of whole groups"):
        SwarmAverager(object(), prefix="p", tensors=[torch.zeros(1)], compression="int4", matchmaking_time=1,
                      averaging_timeout=1)  # fmt: skip


def test_int8_decodes_without_a_warning_about_the_received_buffer():
    """hivemind's 8-bit parts arrive as read-only bytes; decoding copies them rather than handing torch a
    read-only view (torch warns that writing to it would be undefined)."""
    codec, values = Uniform8Bit(), torch.randn(1000, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # hivemind's encoder uses torch's deprecated quantize_per_tensor
        encoded = codec.compress(values, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decoded = codec.extract(encoded)
    inside = values.abs() < 2.5  # 256 levels over mean ± 3 sigma: the tails beyond are clipped
    assert decoded.shape == values.shape and float((decoded - values)[inside].abs().max()) < 0.05


def int8_part(n: int = 100, **header) -> bytes:
    """An int8 part of n values as a round sends it, with `header` fields (dtype, size, requires_grad, buffer)
    replaced."""
    values = torch.randn(n, generator=torch.Generator().manual_seed(n))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # hivemind's encoder uses torch's deprecated quantize_per_tensor
        message = Uniform8Bit().compress(values, None)
    for name, value in header.items():
        if name == "size":
            del message.size[:]
            message.size.extend(value)
        else:
            setattr(message, name, value)
    return message.SerializeToString()


def decode(codec: str, data: bytes, n: int) -> torch.Tensor:
    return WIRE_FORMATS[codec].tcp.decode(memoryview(bytearray(data)), n)


def test_int8_decodes_a_round_part_to_float32_values_without_grad():
    decoded = decode("int8", int8_part(100), 100)
    assert decoded.dtype == torch.float32 and decoded.shape == (100,) and not decoded.requires_grad


def codebook(levels: int, extra: bytes = b"") -> bytes:
    return np.int64(levels).tobytes() + np.zeros(max(min(levels, 4), 0), dtype=np.float32).tobytes() + extra


@pytest.mark.parametrize(
    "header, why",
    [
        ({"dtype": "float64"}, "dtype 'float64'"),
        ({"dtype": "int64"}, "dtype 'int64'"),
        ({"size": [10, 10]}, r"size \[10, 10\]"),
        ({"size": [99]}, r"size \[99\]"),
        ({"requires_grad": True}, "requires_grad True"),
        ({"buffer": codebook(2**60)}, "codebook of 1152921504606846976 levels"),
        ({"buffer": codebook(-1)}, "codebook of -1 levels"),
        ({"buffer": codebook(4, bytes([0, 1, 2, 200] * 25))}, "index 200 beyond a codebook of 4 levels"),
        ({"buffer": codebook(4, bytes(99))}, r"size \[100\] with 99 indices"),
        ({"buffer": b"\1\0\0"}, "buffer of 3 bytes"),
    ],
    ids=["float64", "int64", "2-d", "short-size", "grad", "huge-codebook", "negative-codebook", "index", "few-indices",
         "short-buffer"],
)  # fmt: skip
def test_int8_refuses_a_part_whose_header_does_not_describe_n_float32_values(header: dict, why: str):
    """What a sender claims in the part's header is checked here, so the sender is blamed (ValueError), not the
    reducer's own computations later."""
    with pytest.raises(ValueError, match=why):
        decode("int8", int8_part(100, **header), 100)


def test_int8_refuses_bytes_that_are_no_message():
    with pytest.raises(ValueError, match="not an int8 part"):
        decode("int8", b"\xff" * 20, 100)


@pytest.mark.parametrize("codec, size", [("none", 4), ("fp16", 2)])
def test_plain_formats_refuse_any_length_but_n_values(codec: str, size: int):
    assert decode(codec, bytes(size * 10), 10).shape == (10,)
    for wrong in (bytes(size * 10 - 1), bytes(size * 10 + size), b""):
        with pytest.raises(ValueError, match=f"bytes of {codec} for 10 values"):
            decode(codec, wrong, 10)

"""Sparse rounds: the chunks, the codec's bounds, its refusals, relayed averages over real sockets, error feedback."""

from __future__ import annotations

import io
import math
import struct

import numpy as np
import pytest
import torch

from diloco.outer.error_feedback import ErrorFeedback
from diloco.outer.memory import MemorySwarm
from diloco.swarm.rounds.chunks import CHUNK, Chunks
from diloco.swarm.rounds.codecs import sparse_codec
from diloco.swarm.rounds.layout import Shape, group_layout, plan, plan_schedule
from diloco.swarm.rounds.sparse import SparseCodec, image
from tests.support.outer import Layered, diloco, flat, train_pair
from tests.support.tcp import canonical, randn, run_group

torch.set_num_threads(1)

SHAPES = [(300, 40), (40,), (3, 9000), (7,), (5, 3, 2), (2, 4096)]
NUMEL = sum(math.prod(s) for s in SHAPES)


def test_chunks_are_rows_cut_every_4096_values_and_dense_parameters_cut_anywhere():
    chunks = Chunks(SHAPES)
    starts, lengths, dense = chunks.within(0, NUMEL)
    assert lengths.sum() + dense.sum() == NUMEL
    assert list(lengths[:300]) == [40] * 300  # the first matrix: a chunk per row
    big = 12000 + 40  # the 3 x 9000 matrix: 4096, 4096, 808 per row
    assert list(starts[300:306] + 0) == [big, big + CHUNK, big + 2 * CHUNK, big + 9000, big + 9000 + CHUNK,
                                         big + 9000 + 2 * CHUNK]  # fmt: skip
    assert chunks.floor(big + 9000 + 5000) == big + 9000 + CHUNK
    assert chunks.ceil(big + 9000 + 5000) == big + 9000 + 2 * CHUNK
    assert chunks.floor(12000 + 17) == 12017  # inside the dense (40,)
    assert chunks.runs(0, NUMEL, 5010)[0] == (0, 5000) and all(
        chunks.is_boundary(a) and chunks.is_boundary(b) for a, b in chunks.runs(0, NUMEL, 5010))
    with pytest.raises(ValueError):
        chunks.within(1, 40)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("density", [1 / 16, 1 / 64, 1 / 256])
def test_every_chunk_sends_its_k_largest_values_within_the_quantizers_bound(bits: int, density: float):
    codec = SparseCodec(Chunks(SHAPES), density, bits)
    x = randn(NUMEL, 3)
    y = codec.decode(memoryview(codec.encode(x, 0)), NUMEL, 0)
    assert torch.equal(codec.carry(x, 0), y)  # what error feedback keeps back is exactly what the wire loses
    starts, lengths, dense = codec.chunks.within(0, NUMEL)
    assert torch.equal(y[torch.from_numpy(dense)], x[torch.from_numpy(dense)])  # dense parameters: exact
    for start, length in zip(starts, lengths):
        xs, ys = x[start : start + length], y[start : start + length]
        k = max(1, round(density * length))
        chosen = ys != 0
        assert int(chosen.sum()) == k
        rest = xs[~chosen].abs()
        assert rest.numel() == 0 or float(rest.max()) <= float(xs[chosen].abs().min())  # the k largest
        scale = float(xs.abs().max()) / 2 ** (bits - 1) * (1 + 2**-8)  # (the scale travels in bfloat16)
        assert float((xs[chosen] - ys[chosen]).abs().max()) <= scale  # ±s for those under s/2, else s/2
        assert abs(float(ys.abs().max()) - float(xs.abs().max())) <= scale / 2  # the largest: the scale's rounding
        assert torch.equal(torch.sign(ys[chosen]), torch.sign(xs[chosen]))


def test_positions_coded_by_their_gaps_take_fewer_bytes_than_12_bit_offsets():
    codec = SparseCodec(Chunks([(64, 4096)]), 1 / 64, 2)
    sizes = codec.sizes(randn(64 * 4096, 0), 0)
    assert sizes["selected"] == 64 * 64
    assert sizes["positions"] < 0.7 * sizes["plain_positions"]  # about 7.6 bits against 12
    assert sizes["total"] * 8 / (64 * 4096) < 0.17  # bits per value of the model: 190x fewer than float32


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_value_makes_its_chunk_decode_non_finite(bad: float):
    codec = SparseCodec(Chunks(SHAPES), 1 / 8, 2)
    x = randn(NUMEL, 1)
    x[45] = bad  # the second row of the first matrix
    y = codec.decode(memoryview(codec.encode(x, 0)), NUMEL, 0)
    assert torch.equal(codec.carry(x, 0).nan_to_num(), y.nan_to_num())
    assert int((~torch.isfinite(y[40:80])).sum()) == 5 and torch.isfinite(y[:40]).all()  # its 5 values: screened out


def test_a_message_that_does_not_fit_its_part_is_refused():
    codec = SparseCodec(Chunks(SHAPES), 1 / 8, 2)
    x = randn(NUMEL, 1)
    good = bytearray(codec.encode(x, 0))
    for data in (good[:-1], good + b"\0", good[:3], b""):
        with pytest.raises(ValueError):
            codec.decode(memoryview(bytes(data)), NUMEL, 0)
    with pytest.raises(ValueError):  # a part of other values than it was encoded for
        codec.decode(memoryview(bytes(good)), NUMEL - 6, 0)
    unary_bytes = struct.unpack("!I", good[:4])[0]
    stretched = bytearray(good)
    stretched[-unary_bytes:] = bytes([0x00]) + bytes(stretched[-unary_bytes:-1])  # every gap pushed one byte later
    with pytest.raises(ValueError):
        codec.decode(memoryview(bytes(stretched)), NUMEL, 0)
    with pytest.raises(ValueError):
        codec.decode_relay(memoryview(codec.relay([(good, 1.0)] * 3)), NUMEL, 0, 2)  # more than its senders
    with pytest.raises(ValueError):
        codec.decode_relay(memoryview(codec.relay([(good, -1.0)])), NUMEL, 0, 2)


@pytest.mark.parametrize(
    "mix",
    [[Shape("FULL_SHARD", 1), Shape("FULL_SHARD", 2)], [Shape("DDP", 2), Shape("FULL_SHARD", 3)],
     [Shape("FULL_SHARD", 3), Shape("NO_SHARD", 1), Shape("HYBRID_SHARD", 4, nodes=2)]],
    ids=["1+2", "ddp2+fsdp3", "3+1+hybrid4"],
)  # fmt: skip
def test_groups_of_any_shape_apply_one_relayed_mean_of_the_same_selections(mix: list[Shape]):
    """Each group sends what a one-rank group of the same values would (chunks never straddle shards or replicas),
    every group ends with the same bytes, and they are the weighted mean of the groups' sparse values, computed as
    every holder computes it."""
    codec = sparse_codec(SHAPES, 1 / 8, 2)
    codec = type(codec)(**{**codec.__dict__, "part_numel": 5000})  # many parts, cut across the shards
    layouts = [group_layout(SHAPES, shape, codec.chunks) for shape in mix]
    for layout in layouts:
        assert all(codec.chunks.is_boundary(p.start) and codec.chunks.is_boundary(p.stop)
                   for rank in layout for p in rank.exchanged)  # fmt: skip
    round_plan = plan(layouts, NUMEL, codec.chunks)
    participants = [(g, r) for g, layout in enumerate(layouts) for r in range(len(layout))]
    models = [randn(NUMEL, seed) for seed in range(len(mix))]
    vectors = [torch.cat([models[g][p.start : p.stop] for p in layouts[g][r].held]) for g, r in participants]
    group_weights = [1.0 + g for g in range(len(mix))]
    schedules = [plan_schedule(round_plan, layouts, p, codec.part_numel, codec.chunks) for p in participants]
    outs, errors, rounds, _ = run_group(vectors, codec, [group_weights[g] for g, _ in participants],
                                        schedules=schedules)  # fmt: skip
    assert errors == [None] * len(participants)
    results = [canonical([outs[i] for i, (h, _) in enumerate(participants) if h == g], layout, NUMEL)
               for g, layout in enumerate(layouts)]  # fmt: skip
    assert not results[0].isnan().any()
    assert all(torch.equal(results[0], result) for result in results)
    expected = torch.zeros(NUMEL)
    for weight, model in zip(group_weights, models):
        expected.add_(image(codec, model, 0).mul_(weight))
    assert torch.equal(results[0], expected.div_(sum(group_weights)))
    sent = sum(r.bytes_sent for r in rounds)
    assert sent < 0.5 * 4 * NUMEL * len(mix)  # against every group sending float32 once (the test's model is small)


def test_error_feedback_keeps_what_a_round_did_not_carry_until_a_round_averages():
    codec = sparse_codec(SHAPES, 1 / 64, 2)
    feedback = ErrorFeedback(NUMEL, 0.5, lambda values, fragment: image(codec, values, 0), [])
    delta = randn(NUMEL, 0)
    x = feedback.fold(delta.clone())
    assert torch.equal(x, delta)  # nothing kept yet
    feedback.failed()
    assert not feedback.error.any()  # a failed round keeps nothing of it (its steps carry over)
    x = feedback.fold(delta.clone())
    feedback.averaged()
    assert torch.equal(feedback.error, x - image(codec, x, 0))
    kept = feedback.error.clone()
    second = randn(NUMEL, 1)
    x = feedback.fold(second.clone())
    assert torch.equal(x, second + 0.5 * kept)
    feedback.applied_alone()
    assert not feedback.error.any()  # all of x applied
    feedback.error.copy_(kept)
    feedback.averaged()  # a round this group joined with nothing of its own (weight 0): its buffer stays
    feedback.applied_alone()
    assert torch.equal(feedback.error, kept)
    restored = ErrorFeedback(NUMEL, 0.5, feedback.image, [])
    restored.load_state_dict(feedback.state_dict())
    assert torch.equal(restored.error, kept)
    restored.reset()
    assert not restored.error.any()


def test_the_decay_and_the_selection_of_a_buffer_add_up_over_rounds():
    """SparseLoCo's recursion on one worker: every value is sent eventually, none twice, whatever the selection."""
    codec = sparse_codec([(4, 4096)], 1 / 64, 8)
    feedback = ErrorFeedback(4 * 4096, 1.0, lambda values, fragment: image(codec, values, 0), [])
    delta, sent = randn(4 * 4096, 0), torch.zeros(4 * 4096)
    for step in range(40):
        x = feedback.fold(delta.clone() if step == 0 else torch.zeros(4 * 4096))
        sent += image(codec, x, 0)
        feedback.averaged()
    assert torch.allclose(sent + feedback.error, delta, atol=1e-5)
    assert float(feedback.error.norm()) < 0.5 * float(delta.norm())
    assert np.isclose(float((sent != 0).float().mean()), min(1.0, 40 / 64), atol=0.02)


def sparse_pair(nets: dict[int, Layered], decay: float, momentum: float, final_step: int = 12):
    shapes = [tuple(p.shape) for p in nets[0].parameters()]
    hub = MemorySwarm(2, codec=sparse_codec(shapes, 0.25, 2))
    outers = {g: diloco(nets[g], hub.member(f"g{g}"), 1.0, momentum, 2, world_rank=g, error_decay=decay,
                        final_step=final_step) for g in (0, 1)}  # fmt: skip
    return hub, outers


@pytest.mark.parametrize("rule", [(0.95, 0.0), (1.0, 0.9)], ids=["sparseloco", "nesterov"])
def test_two_groups_of_sparse_rounds_stay_identical_and_a_resume_from_their_state_ends_the_same(rule):
    """Two groups, a round every 2 steps with a quarter of each row sent: after every round one outer state; the
    run resumed from both groups' state after 3 rounds (through torch.save, as a checkpoint holds it) ends on the
    very same model as the run straight through, error buffers included."""
    decay, momentum = rule
    nets = {g: Layered() for g in (0, 1)}
    _, outers = sparse_pair(nets, decay, momentum)
    rows = train_pair(nets, outers, range(12))
    digests = [{r["outer_step"]: r["outer_digest"] for r in rows[g]} for g in (0, 1)]
    assert digests[0] == digests[1] and len(digests[0]) == 6 and all(r["num_peers"] == 2 for r in rows[0])
    assert torch.equal(flat(nets[0]), flat(nets[1]))
    assert all(outers[g].feedback.error.any() for g in (0, 1))  # something is held back
    straight = flat(nets[0]).clone()

    nets = {g: Layered() for g in (0, 1)}
    _, outers = sparse_pair(nets, decay, momentum)
    train_pair(nets, outers, range(6))
    saved = {}
    for g in (0, 1):
        buffer = io.BytesIO()
        torch.save({"outer": outers[g].state_dict(), "net": nets[g].state_dict()}, buffer)
        saved[g] = buffer.getvalue()
    nets = {g: Layered(seed=7) for g in (0, 1)}  # other weights, overwritten by the checkpoint
    _, outers = sparse_pair(nets, decay, momentum)
    for g in (0, 1):
        state = torch.load(io.BytesIO(saved[g]), weights_only=False)
        nets[g].load_state_dict(state["net"])
        outers[g].load_state_dict(state["outer"])
        outers[g].step = 6
    train_pair(nets, outers, range(6, 12))
    assert torch.equal(flat(nets[0]), straight) and torch.equal(flat(nets[1]), straight)


def test_a_non_finite_sparse_contribution_is_screened_out_and_the_others_average():
    codec = sparse_codec(SHAPES, 1 / 8, 2)
    shape = Shape("FULL_SHARD", 1)
    layouts = [group_layout(SHAPES, shape, codec.chunks) for _ in range(3)]
    round_plan = plan(layouts, NUMEL, codec.chunks)
    schedules = [plan_schedule(round_plan, layouts, (g, 0), codec.part_numel, codec.chunks) for g in range(3)]
    vectors = [randn(NUMEL, g) for g in range(3)]
    vectors[2][5] = float("nan")  # in the first span: its reducer leaves it out; the other reducers take it
    outs, errors, rounds, _ = run_group(vectors, codec, schedules=schedules)
    assert errors[0] is None and errors[1] is None and errors[2] is not None  # its own round fails
    assert [r.rejected for r in rounds] == [1, 0, 0]
    images = [image(codec, v.nan_to_num(), 0) for v in vectors]
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[0]).all()
    for span in round_plan.spans:  # reducer 0 left it out of all its spans from the first on
        kept = images[:2] if span.reducer == (0, 0) else images
        assert torch.allclose(outs[0][span.start : span.stop], sum(kept)[span.start : span.stop] / len(kept),
                              atol=1e-6), span  # fmt: skip


def test_a_sparse_round_where_nobody_has_weight_fails_everywhere():
    """The relayed mean of contributions that all weigh 0 is 0/0: every peer's round fails rather than apply it."""
    codec = sparse_codec(SHAPES, 1 / 8, 2)
    layouts = [group_layout(SHAPES, Shape("FULL_SHARD", 1), codec.chunks) for _ in range(2)]
    round_plan = plan(layouts, NUMEL, codec.chunks)
    schedules = [plan_schedule(round_plan, layouts, (g, 0), codec.part_numel, codec.chunks) for g in range(2)]
    outs, errors, _, _ = run_group([randn(NUMEL, g) for g in range(2)], codec, [0.0, 0.0], schedules=schedules)
    assert all(error is not None and "NaN/Inf" in error for error in errors), errors

"""Streaming DiLoCo's fragments and overlapped rounds (``--hv.fragments``, ``--hv.overlap-steps``): which parameters
a fragment holds, the stagger, the fragment's outer step and the overlap's merge against hand computation, and
bit-identical outer states across groups of the in-memory swarm."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pydantic
import pytest
import torch

from diloco.config import HvConfig
from diloco.errors import FieldError
from diloco.outer.diloco import DiLoCo
from diloco.outer.fragments import fragment_of, fragment_params, local_runs
from diloco.outer.links import solo_group
from diloco.outer.memory import Member, MemorySwarm, Report
from diloco.outer.optimizer import OuterOptimizer
from diloco.outer.pace import check_overlap
from tests.support.outer import LAYERS, Layered, flat, runs_of, train_pair


def test_fragments_hold_whole_layers_strided_or_contiguous() -> None:
    assert fragment_params(LAYERS, 2, "strided") == [[0, 1, 2, 3, 6, 7], [4, 5, 8, 9, 10]]
    assert fragment_params(LAYERS, 2, "contiguous") == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert fragment_params(LAYERS, 3, "contiguous") == [[0, 1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    for count in (1, 2, 3, 4):
        for layout in ("strided", "contiguous"):
            fragments = fragment_params(LAYERS, count, layout)
            assert sorted(i for f in fragments for i in f) == list(range(len(LAYERS)))  # each exactly once
    with pytest.raises(ValueError, match="4 decoder layers"):
        fragment_params(LAYERS, 5)
    assert [fragment_of(r, 3) for r in range(1, 8)] == [0, 1, 2, 0, 1, 2, 0]


def test_local_runs_merge_neighbours_and_skip_empty_shards() -> None:
    numels = [2, 0, 3, 4]  # a rank whose shard of parameter 1 is empty
    assert local_runs([0, 3], numels) == [(0, 2), (5, 9)]
    assert local_runs([2, 0, 1], numels) == [(0, 5)]
    assert local_runs([1], numels) == []


def test_fragment_outer_step_by_hand_leaves_the_other_fragment_alone() -> None:
    """Nesterov SGD on fragment 0 (values 0-1) only: v = m·v + Δ; θ ← θ − lr·(Δ + m·v); fragment 1's outer
    values, momentum and model values do not move. With one fragment the step equals torch's SGD bit for bit."""
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    outer = OuterOptimizer([a, b], lr=0.5, momentum=0.9, fragments=[[(0, 2)], [(2, 4)]])
    theta, velocity = torch.tensor([1.0, 2.0]), torch.zeros(2)
    for moved in (torch.tensor([0.8, 2.5]), torch.tensor([0.1, -0.3])):
        a.copy_(theta - moved)
        b.add_(1.0)  # fragment 1 trains too, but is not averaged in this round
        b_before = b.clone()
        delta = outer.pseudo_gradient(0)
        assert torch.allclose(delta, moved)
        outer.step(delta, 0)
        velocity = 0.9 * velocity + delta
        theta = theta - 0.5 * (delta + 0.9 * velocity)
        assert torch.allclose(outer.outer[:2], theta) and torch.equal(a, outer.outer[:2])
        assert torch.equal(outer.outer[2:], torch.tensor([3.0, 4.0])) and torch.equal(b, b_before)
        assert torch.equal(outer.optimizer.state[outer.outer]["momentum_buffer"][2:], torch.zeros(2))
    whole = [torch.tensor([1.0, 2.0, 3.0])]
    mine, torchs = OuterOptimizer(whole, 0.7, 0.9, fragments=[[(0, 3)]]), OuterOptimizer([whole[0].clone()], 0.7, 0.9)
    for grad in (torch.tensor([0.3, -0.1, 0.7]), torch.tensor([0.2, 0.5, -0.4])):
        mine.step(grad.clone(), 0)
        torchs.step(grad.clone())
        assert torch.equal(mine.outer, torchs.outer)


class Recording(Member):
    """Alone in the swarm; remembers each round's index, fragment and size."""

    def __init__(self) -> None:
        super().__init__(MemorySwarm(1), "alone")
        self.rounds: list[tuple[int, Any, int]] = []

    def average(
        self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: object, fragment: object = None,
        outer_step: int | None = None,
        last: bool = False,
    ) -> Report:
        self.rounds.append((round_index, fragment, tensors[0].numel()))
        return Report(num_peers=1)


def outer_loop(net: torch.nn.Module, swarm: Member, h: int, **kw: Any) -> DiLoCo:
    return DiLoCo([p.data for p in net.parameters()], swarm, solo_group(), world_rank=kw.pop("world_rank", 0),
                  local_steps=h, **kw)  # fmt: skip


def test_each_parameter_is_averaged_once_every_h_steps_on_a_stagger() -> None:
    """H = 4, F = 2: fragment 0 at steps 2 and 6, fragment 1 at 4 and 8, and the last step (8) also averages
    fragment 0 again, so the final model holds every inner step. A fragment's round resets its own values only."""
    net, swarm = Layered(), Recording()
    fragments = runs_of(net, 2)
    outer = outer_loop(net, swarm, 4, outer_lr=1.0, outer_momentum=0.0, fragments=fragments, final_step=8)
    sizes = [sum(b - a for a, b in runs) for runs in fragments]
    when = []
    for step in range(1, 9):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.01 * step)
        before = flat(net).clone()
        report = outer.after_inner_step(step)
        if report is not None:
            when.append(step)
            if step == 2:  # fragment 1 kept its inner steps; fragment 0 holds the new outer values
                assert all(torch.equal(flat(net)[a:b], before[a:b]) for a, b in fragments[1])
                assert all(torch.equal(flat(net)[a:b], outer.outer[a:b]) for a, b in fragments[0])
    assert when == [2, 4, 6, 8]
    assert [(i, f) for i, f, _ in swarm.rounds] == [(1, 0), (2, 1), (3, 0), (4, 1), (5, 0)]
    assert [n for _, f, n in swarm.rounds] == [sizes[f] for _, f, _ in swarm.rounds]
    assert outer.outer_step == 5 and torch.equal(flat(net), outer.outer)  # the final model is the outer one


def test_an_overlapped_round_lands_t_steps_later_merged_by_hand() -> None:
    """Alone, H = 2, T = 1, mix 0.5, outer lr 1 without momentum, outer θ = 1. Step 2 sends Δ = 1 − 0.8 = 0.2 and
    trains on; at step 3 (the weight now 0.7) it lands: θ = 1 − 0.2 = 0.8 and the weight 0.5·0.7 + 0.5·0.8 = 0.75.
    The last step (4, weight 0.65) is a blocking round: θ = 0.8 − (0.8 − 0.65) = 0.65, and the model is θ."""
    net = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        net.weight.fill_(1.0)
    swarm = Recording()
    outer = outer_loop(net, swarm, 2, outer_lr=1.0, outer_momentum=0.0, overlap_steps=1, overlap_mix=0.5,
                       final_step=4)  # fmt: skip
    rows = {}
    for step, weight in ((1, 0.9), (2, 0.8), (3, 0.7), (4, 0.65)):
        with torch.no_grad():
            net.weight.fill_(weight)
        report = outer.after_inner_step(step)
        rows[step] = None if report is None else report.row
        if step == 2:
            assert report.row is None and outer.outer.item() == 1.0  # on the wire: nothing applied yet
    assert rows[3]["round_step"] == 2 and rows[3]["outer_step"] == 1
    assert 0 <= rows[3]["land_wait_s"] <= rows[3]["land_s"] and rows[3]["side_cpu_s"] >= 0
    assert rows[3]["pseudo_grad_norm"] == pytest.approx(0.2)
    assert outer.outer.item() == pytest.approx(0.65) and net.weight.item() == pytest.approx(0.65)
    assert [i for i, _, _ in swarm.rounds] == [1, 2]


@pytest.mark.parametrize("overlap", [0, 1])
def test_two_groups_stay_bit_identical_after_every_fragment_round(overlap: int) -> None:
    """Two groups train on their own batches, F = 2, H = 4, Nesterov 0.7/0.9, blocking or overlapped by one step:
    after every fragment round both hold one outer state (the same digest), and they end on one model."""
    hub = MemorySwarm(2)
    nets = {g: Layered() for g in (0, 1)}
    outers = {
        g: outer_loop(nets[g], hub.member(f"g{g}"), 4, world_rank=g, outer_lr=0.7, outer_momentum=0.9,
                      fragments=runs_of(nets[g], 2), overlap_steps=overlap, final_step=12)
        for g in (0, 1)
    }  # fmt: skip
    rows = train_pair(nets, outers, range(12))
    digests = [{r["outer_step"]: r["outer_digest"] for r in rows[g]} for g in (0, 1)]
    assert digests[0] == digests[1] and len(digests[0]) >= 4, rows
    # a row per fragment round, the last step's two included (fragment 1's, then fragment 0's again)
    assert [r["outer_step"] for r in rows[0]] == list(range(1, 8)), rows[0]
    assert [r["fragment"] for r in rows[0] if r["step"] == 12] == [1, 0]
    assert all(r["num_peers"] == 2 for g in (0, 1) for r in rows[g])
    assert {r["fragment"] for r in rows[0]} == {0, 1}
    assert all(("round_step" in r) == bool(overlap) for r in rows[0] if r["step"] < 12)  # landed T steps later
    assert outers[0].outer_step == outers[1].outer_step == 7  # rounds at 2, 4, ..., 12, and fragment 0 again
    assert torch.equal(flat(nets[0]), flat(nets[1])) and torch.equal(flat(nets[0]), outers[0].outer)


def test_fragments_and_overlap_must_fit_h() -> None:
    HvConfig(galaxy_size=2, local_steps=6, fragments=3, overlap_steps=1)
    for bad, words in (
        ({"local_steps": 10, "fragments": 3}, "must be a multiple of --hv.fragments"),
        ({"local_steps": 6, "fragments": 3, "overlap_steps": 2}, "--hv.overlap-steps 2 must be smaller"),
    ):
        with pytest.raises(pydantic.ValidationError, match=words):
            HvConfig(galaxy_size=2, **bad)
    # under a token budget the rounds' length in inner steps is known once the tokens per step are:
    # 1000 / (2 fragments x 2 groups x 50 tokens) = 5 inner steps between two rounds
    budget = HvConfig(galaxy_size=2, target_tokens=1000, fragments=2, overlap_steps=4)
    check_overlap(budget, tokens_per_step=50)
    with pytest.raises(FieldError, match=r"overlap_steps 4 must be smaller .* = 4\.0$") as refused:
        check_overlap(budget, tokens_per_step=63)  # 3.97 steps
    assert refused.value.fields == ["overlap_steps", "target_tokens", "fragments", "galaxy_size"]


def test_each_fragments_start_survives_a_checkpoint() -> None:
    """Under a token budget a fragment's weight counts its tokens since its own last round: where each fragment
    starts goes into the checkpoint; one from before fragments had their own starts from the round's start."""
    net = Layered()
    outer = outer_loop(net, Recording(), 4, outer_lr=1.0, outer_momentum=0.0, fragments=runs_of(net, 2))
    outer.ledger.round_start, outer.ledger.fragment_start = 6, [6, 4]
    saved = outer.state_dict()
    resumed = outer_loop(Layered(), Recording(), 4, outer_lr=1.0, outer_momentum=0.0, fragments=runs_of(net, 2))
    resumed.load_state_dict(saved)
    assert (resumed.ledger.round_start, resumed.ledger.fragment_start) == (6, [6, 4])
    resumed.load_state_dict({k: v for k, v in saved.items() if k != "fragment_start"})
    assert resumed.ledger.fragment_start == [6, 6]

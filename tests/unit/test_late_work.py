"""A group that arrives after the swarm's round formed: with ``--hv.late-work keep`` its inner steps land in the next
round it takes part in, weighted by their tokens; with ``drop`` they are thrown away, and counted either way."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from diloco.outer.diloco import DiLoCo
from diloco.outer.memory import Member, MemorySwarm, Report
from diloco.outer.optimizer import OuterOptimizer
from diloco.outer.pace import FixedSteps
from tests.support.outer import diloco

TOKENS = 64  # per inner step of each group


class Spy(Member):
    """A member that keeps what it sent to each round (a copy of the tensors and the weight), and whose round
    `fail_round` fails on its side only (the others' succeeds without it)."""

    def __init__(self, hub: MemorySwarm, name: str, fail_round: int | None = None) -> None:
        super().__init__(hub, name)
        self.fail_round = fail_round
        self.sent: dict[int, tuple[torch.Tensor, float]] = {}

    def average(self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: object,
                fragment: object = None, outer_step: int | None = None, last: bool = False) -> Report:  # fmt: skip
        self.sent[round_index] = (tensors[0].clone(), weight)
        if round_index == self.fail_round:
            self.swarm.barrier.wait()  # the others' round goes on without this group's contribution
            self.swarm.barrier.wait()
            return Report(num_peers=0, ok=False)
        return super().average(tensors, round_index, weight, stop, fragment, outer_step, last)


class Solo(Member):
    """The other side of a failed round: group 0 averages alone in `alone_round` (its partner's part failed)."""

    def __init__(self, hub: MemorySwarm, name: str, alone_round: int) -> None:
        super().__init__(hub, name)
        self.alone_round = alone_round

    def average(self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: object,
                fragment: object = None, outer_step: int | None = None, last: bool = False) -> Report:  # fmt: skip
        if round_index == self.alone_round:
            self.swarm.barrier.wait()
            self.swarm.barrier.wait()
            return Report(num_peers=1)  # it applies its own pseudo-gradient
        return super().average(tensors, round_index, weight, stop, fragment, outer_step, last)


def net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def train(outers: dict[int, DiLoCo], nets: dict[int, torch.nn.Module], steps: range) -> dict[int, list[dict]]:
    """Each group takes SGD steps on its own batches and calls the outer loop, in its own thread."""
    rows: dict[int, list[dict]] = {g: [] for g in outers}

    def run(group: int) -> None:
        opt = torch.optim.SGD(nets[group].parameters(), lr=0.05)
        for step in steps:
            g = torch.Generator().manual_seed(100 * step + group)
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(nets[group](x), y).backward()
            opt.step()
            report = outers[group].after_inner_step(step + 1)
            if report is not None:
                rows[group].extend(report.rows)

    with ThreadPoolExecutor(len(outers)) as pool:
        list(pool.map(run, outers))
    return rows


def late_pair(late_work: str) -> tuple[dict[int, torch.nn.Module], dict[int, DiLoCo], Spy]:
    """Two groups, H = 2; group 1 misses round 1 (its side fails), so group 0 averages alone and moves ahead."""
    hub = MemorySwarm(2)
    nets = {g: net() for g in (0, 1)}
    spy = Spy(hub, "g1", fail_round=1)
    members = {0: Solo(hub, "g0", alone_round=1), 1: spy}
    outers = {
        g: diloco(nets[g], members[g], lr=0.7, momentum=0.0, h=2, world_rank=g, tokens_per_step=TOKENS,
                  late_work=late_work)  # fmt: skip
        for g in (0, 1)
    }
    for g in (0, 1):
        outers[g].join(0)
    return nets, outers, spy


def test_kept_late_work_lands_in_the_next_round_weighted_by_its_tokens() -> None:
    nets, outers, spy = late_pair("keep")
    train(outers, nets, range(0, 2))  # round 1: group 0 alone, group 1's side failed
    assert (outers[0].outer_step, outers[1].outer_step) == (1, 0)
    missed, _ = spy.sent[1]
    rows = train(outers, nets, range(2, 4))  # round 2: group 1 loads group 0's state, keeping its 4 inner steps
    [landed] = rows[1]  # it loaded at the boundary and joined the round under way: one row
    assert landed["loaded_state_from"] == 0 and landed["carried_steps"] == 4 and landed["discarded_steps"] == 0
    sent, weight = spy.sent[2]
    assert weight == 2.0  # two rounds' worth of tokens (H = 2 steps each), against group 0's 1.0
    # what it sent holds the missed round's pseudo-gradient: the model moved with the outer parameters
    fresh = sent - missed
    assert fresh.norm() < sent.norm() and torch.allclose(sent, missed + fresh)
    assert landed["num_peers"] == 2 and landed["weight"] == 2.0 and landed["tokens"] == 4 * TOKENS
    assert torch.equal(outers[0].outer, outers[1].outer)  # one swarm state again
    assert outers[1].summary()["discarded_steps"] == 0 and outers[0].summary()["discarded_steps"] == 0


def test_the_late_groups_next_round_after_a_load_carries_the_missed_steps() -> None:
    """The pseudo-gradient a late group sends after loading equals, up to rounding, the one it had before the load
    plus its inner steps since: `OuterOptimizer.load(keep=True)` moves the model by what the outer parameters moved."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    outer = OuterOptimizer([p.data for p in model.parameters()], lr=0.7, momentum=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # inner steps
    before = outer.pseudo_gradient()
    newer = [outer.outer + torch.randn_like(outer.outer)]
    outer.load(5, newer, keep=True)
    assert outer.steps == 5 and torch.equal(outer.outer, newer[0])
    assert torch.allclose(outer.pseudo_gradient(), before, atol=1e-6)
    outer.load(6, [outer.outer * 2])  # without keep: reset to the loaded state exactly
    assert outer.model_is_outer()


def test_dropped_late_work_is_counted_in_the_rows_and_the_summary() -> None:
    nets, outers, spy = late_pair("drop")
    train(outers, nets, range(0, 2))
    rows = train(outers, nets, range(2, 4))
    [load] = rows[1]  # it loaded at the boundary and joined the round under way with no weight
    assert load["loaded_state_from"] == 0 and load["discarded_steps"] == 4
    assert load["discarded_tokens"] == 4 * TOKENS and "carried_steps" not in load
    assert spy.sent[2][1] == 0.0 and not spy.sent[2][0].any()
    assert train(outers, nets, range(4, 6))[1][-1]["discarded_steps"] == 0  # counted once
    summary = outers[1].summary()
    assert (summary["discarded_steps"], summary["discarded_tokens"]) == (4, 4 * TOKENS)
    assert outers[1].beacon.discarded_steps == 4 and outers[0].summary()["discarded_steps"] == 0


def test_a_group_that_averaged_alone_and_then_loads_another_state_counts_that_round_as_discarded() -> None:
    """Both groups averaged round 1 alone (they missed each other): two states of one outer step. The one that loads
    the other's loses the inner steps of its lone round, even when it keeps its later ones."""
    hub = MemorySwarm(2)
    nets = {g: net() for g in (0, 1)}
    outers = {g: diloco(nets[g], Solo(hub, f"g{g}", alone_round=1), lr=0.7, momentum=0.0, h=2, world_rank=g,
                        tokens_per_step=TOKENS) for g in (0, 1)}  # fmt: skip
    for g in (0, 1):
        outers[g].join(0)
    train(outers, nets, range(0, 2))
    assert outers[0].tainted and outers[1].tainted and not torch.equal(outers[0].outer, outers[1].outer)
    loader = next(g for g in (0, 1) if outers[g]._plan())  # the catch-up picks one state of the two
    assert outers[loader]._load_from(outers[loader]._plan()) is not None
    assert outers[loader].ledger.discarded_steps == 2 and outers[1 - loader].ledger.discarded_steps == 0


@pytest.mark.parametrize(("tokens", "weight"), [(0, 1.0), (100, 1.0), (200, 1.0), (500, 2.5)])
def test_a_fixed_h_round_weighs_the_rounds_of_tokens_it_brings(tokens: int, weight: float) -> None:
    assert FixedSteps(10, None, tokens_per_h=200).weight(tokens) == weight
    assert FixedSteps(10, None).weight(tokens) == 1.0  # tokens unknown: every round weighs 1


class Lone(Member):
    """A member that never meets anyone (it averages alone), and keeps what it sent."""

    def __init__(self, hub: MemorySwarm, name: str) -> None:
        super().__init__(hub, name)
        self.sent: dict[int, tuple[torch.Tensor, float]] = {}

    def average(self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: object,
                fragment: object = None, outer_step: int | None = None, last: bool = False) -> Report:  # fmt: skip
        self.sent[round_index] = (tensors[0].clone(), weight)
        return Report(num_peers=1)


def test_under_fixed_h_a_late_group_takes_its_kept_steps_to_the_swarms_next_round_at_once() -> None:
    """Group 0 took rounds 1 and 2 while group 1 trained its first round: at its boundary (step 2) group 1 loads
    outer step 2 and goes to round 3 now (inner step 6), with the two steps it kept; at its own pace it would reach
    every round after the swarm had taken it, and its steps would never land."""
    hub = MemorySwarm(2)
    nets = {g: net() for g in (0, 1)}
    members = {g: Lone(hub, f"g{g}") for g in (0, 1)}
    outers = {g: diloco(nets[g], members[g], lr=0.7, momentum=0.0, h=2, world_rank=g, tokens_per_step=TOKENS,
                        final_step=10, late_work="keep") for g in (0, 1)}  # fmt: skip
    for g in (0, 1):
        outers[g].join(0)
    train({0: outers[0]}, {0: nets[0]}, range(0, 4))  # group 0: rounds 1 and 2 (alone)
    assert outers[0].outer_step == 2
    [row] = train({1: outers[1]}, {1: nets[1]}, range(0, 2))[1]
    assert row["loaded_state_from"] == 0 and row["step"] == 6 and row["carried_steps"] == 2
    assert sorted(members[1].sent) == [3] and members[1].sent[3][1] == 1.0  # one round of tokens, in round 3
    assert row["tokens"] == 2 * TOKENS and row["discarded_steps"] == 0 and outers[1].step == 6
    assert outers[1].outer_step == 3  # (alone here: this member meets nobody)


class Overtaken(Lone):
    """A lone member during whose first round another group closes the same round and moves on (`meanwhile`): the
    race of a late group that loaded a state just before its source took the next step."""

    def __init__(self, hub: MemorySwarm, name: str) -> None:
        super().__init__(hub, name)
        self.meanwhile: list[Callable[[], object]] = []

    def average(self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: object,
                fragment: object = None, outer_step: int | None = None, last: bool = False) -> Report:  # fmt: skip
        while self.meanwhile:
            self.meanwhile.pop()()
        return super().average(tensors, round_index, weight, stop, fragment, outer_step, last)


def test_a_lone_round_the_swarm_is_already_past_applies_nothing_and_the_kept_steps_carry_on() -> None:
    """Group 1 loads outer step 1 and takes its kept steps to round 2, which group 0 closes (alone) meanwhile. Group 1
    applies nothing alone (that step would be replaced at its next load, and its steps lost), carries them on, and
    brings all four to round 3 with nothing discarded. (Nobody past it: it applies its own step, as the paper; see
    the test above.)"""
    hub = MemorySwarm(2)
    nets = {g: net() for g in (0, 1)}
    members = {0: Lone(hub, "g0"), 1: Overtaken(hub, "g1")}
    outers = {g: diloco(nets[g], members[g], lr=0.7, momentum=0.0, h=2, world_rank=g, tokens_per_step=TOKENS,
                        final_step=10, late_work="keep") for g in (0, 1)}  # fmt: skip
    for g in (0, 1):
        outers[g].join(0)
    train({0: outers[0]}, {0: nets[0]}, range(0, 2))  # group 0: round 1, alone
    members[1].meanwhile.append(lambda: train({0: outers[0]}, {0: nets[0]}, range(2, 4)))  # and round 2
    [row] = train({1: outers[1]}, {1: nets[1]}, range(0, 2))[1]
    assert row["loaded_state_from"] == 0 and outers[0].outer_step == 2
    assert row["sat_out"] is True and row["num_peers"] == 1 and outers[1].outer_step == 1
    assert row["carried_steps"] == 2 and row["discarded_steps"] == 0
    [row] = train({1: outers[1]}, {1: nets[1]}, range(4, 6))[1]  # loads outer step 2, keeping all four steps
    assert row["loaded_state_from"] == 0 and row["discarded_steps"] == 0 and "sat_out" not in row
    assert members[1].sent[3][1] == 2.0 and row["tokens"] == 4 * TOKENS  # round 3: two rounds' worth of tokens
    assert outers[1].summary()["discarded_steps"] == 0

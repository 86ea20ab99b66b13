"""A group that arrives after the swarm's round formed: with ``--hv.late-work keep`` its inner steps land in the next
round it takes part in, weighted by their tokens; with ``drop`` they are thrown away, and counted either way."""

from __future__ import annotations

import logging
import threading
import time
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
    """The other side of a failed round: group 0 averages alone in `alone_round` (its partner's part failed). With
    `peers` 2 the round is torn instead: group 0 counts its partner in (its part may be in the average) and applies it
    as an average."""

    def __init__(self, hub: MemorySwarm, name: str, alone_round: int, peers: int = 1) -> None:
        super().__init__(hub, name)
        self.alone_round, self.peers = alone_round, peers

    def average(self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: object,
                fragment: object = None, outer_step: int | None = None, last: bool = False) -> Report:  # fmt: skip
        if round_index == self.alone_round:
            self.swarm.barrier.wait()
            self.swarm.barrier.wait()
            return Report(num_peers=self.peers)  # it applies its own pseudo-gradient
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


def late_pair(late_work: str, torn: bool = False) -> tuple[dict[int, torch.nn.Module], dict[int, DiLoCo], Spy]:
    """Two groups, H = 2; group 1 misses round 1 (its side fails), so group 0 averages alone (`torn`: it applies the
    round as an average) and moves ahead."""
    hub = MemorySwarm(2)
    nets = {g: net() for g in (0, 1)}
    spy = Spy(hub, "g1", fail_round=1)
    members = {0: Solo(hub, "g0", alone_round=1, peers=2 if torn else 1), 1: spy}
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
    """A torn round 1: group 0 applied it as an average, which may hold group 1's part, so group 1 cannot keep its
    steps without counting them twice; under drop it loads over them."""
    nets, outers, spy = late_pair("drop", torn=True)
    train(outers, nets, range(0, 2))
    assert not outers[0].tainted and outers[0].outer_step == 1 and outers[1].outer_step == 0
    rows = train(outers, nets, range(2, 4))
    [load] = rows[1]  # it loaded at the boundary and joined the round under way with no weight
    assert load["loaded_state_from"] == 0 and load["discarded_steps"] == 4
    assert load["discarded_tokens"] == 4 * TOKENS and "carried_steps" not in load
    assert spy.sent[2][1] == 0.0 and not spy.sent[2][0].any()
    assert train(outers, nets, range(4, 6))[1][-1]["discarded_steps"] == 0  # counted once
    summary = outers[1].summary()
    assert (summary["discarded_steps"], summary["discarded_tokens"]) == (4, 4 * TOKENS)
    assert outers[1].beacon.discarded_steps == 4 and outers[0].summary()["discarded_steps"] == 0


def test_under_drop_a_group_whose_round_failed_on_its_side_while_the_other_took_it_alone_keeps_its_steps() -> None:
    """Group 1 was in round 1 on time; its side failed, and group 0 applied its own step alone (a split round). The
    state group 1 then loads holds none of its 4 inner steps: it keeps them whatever --hv.late-work says, and they
    land in round 2, as with keep."""
    nets, outers, spy = late_pair("drop")
    train(outers, nets, range(0, 2))
    assert outers[0].tainted and (outers[0].outer_step, outers[1].outer_step) == (1, 0)
    [landed] = train(outers, nets, range(2, 4))[1]
    assert landed["loaded_state_from"] == 0 and landed["carried_steps"] == 4 and landed["discarded_steps"] == 0
    assert spy.sent[2][1] == 2.0 and landed["num_peers"] == 2 and landed["tokens"] == 4 * TOKENS
    assert torch.equal(outers[0].outer, outers[1].outer) and not outers[1].keeping
    assert outers[1].summary()["discarded_steps"] == 0 and outers[0].summary()["discarded_steps"] == 0


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


def keeping_pair(members: dict[int, Member]) -> tuple[dict[int, torch.nn.Module], dict[int, DiLoCo]]:
    """Two groups of `members` that keep late work (H = 2, fixed), joined; group 0 has taken round 1 (alone)."""
    nets = {g: net() for g in (0, 1)}
    outers = {g: diloco(nets[g], members[g], lr=0.7, momentum=0.0, h=2, world_rank=g, tokens_per_step=TOKENS,
                        final_step=10, late_work="keep") for g in (0, 1)}  # fmt: skip
    for g in (0, 1):
        outers[g].join(0)
    train({0: outers[0]}, {0: nets[0]}, range(0, 2))
    return nets, outers


def test_a_lone_round_the_swarm_is_already_past_applies_nothing_and_the_kept_steps_carry_on() -> None:
    """Group 1 loads outer step 1 and takes its kept steps to round 2, which group 0 closes (alone) meanwhile. Group 1
    applies nothing alone (that step would be replaced at its next load, and its steps lost), carries them on, and
    brings all four to round 3 with nothing discarded. (Nobody past it: it applies its own step, as the paper; see
    the test above.)"""
    hub = MemorySwarm(2)
    members = {0: Lone(hub, "g0"), 1: Overtaken(hub, "g1")}
    nets, outers = keeping_pair(members)
    members[1].meanwhile.append(lambda: train({0: outers[0]}, {0: nets[0]}, range(2, 4)))  # and round 2
    [row] = train({1: outers[1]}, {1: nets[1]}, range(0, 2))[1]
    assert row["loaded_state_from"] == 0 and outers[0].outer_step == 2
    assert row["sat_out"] is True and row["num_peers"] == 1 and outers[1].outer_step == 1
    assert row["carried_steps"] == 2 and row["discarded_steps"] == 0
    [row] = train({1: outers[1]}, {1: nets[1]}, range(4, 6))[1]  # loads outer step 2, keeping all four steps
    assert row["loaded_state_from"] == 0 and row["discarded_steps"] == 0 and "sat_out" not in row
    assert members[1].sent[3][1] == 2.0 and row["tokens"] == 4 * TOKENS  # round 3: two rounds' worth of tokens
    assert outers[1].summary()["discarded_steps"] == 0


def test_a_group_that_joined_its_sources_round_and_found_nobody_sits_out_though_no_record_says_so() -> None:
    """Group 1 loads the state group 0 serves while in round 2's matchmaking (outer step 1, inner step 4), so it joins
    round 2 with its kept steps, and finds nobody: group 0's round formed without it (here: nobody meets anyone). No
    record shows the swarm past round 2 yet (group 0 is still in it; under load its new record can also come late,
    or not at all). Group 1 sits out all the same: applied alone, its step would be replaced at its next load and its
    two inner steps thrown away. They land at round 3."""
    hub = MemorySwarm(2)
    members = {0: Overtaken(hub, "g0"), 1: Lone(hub, "g1")}
    nets, outers = keeping_pair(members)
    late: list[dict] = []
    members[0].meanwhile.append(lambda: late.extend(train({1: outers[1]}, {1: nets[1]}, range(0, 2))[1]))
    train({0: outers[0]}, {0: nets[0]}, range(2, 4))  # group 0's round 2, during which group 1 comes
    [row] = late
    assert row["loaded_state_from"] == 0 and outers[1].loaded_step == 4 and row["step"] == 4
    assert row["sat_out"] is True and outers[1].outer_step == 1 and outers[1].ledger.alone_steps == 0
    assert outers[0].outer_step == 2
    [row] = train({1: outers[1]}, {1: nets[1]}, range(4, 6))[1]  # loads outer step 2, keeping both steps
    assert row["loaded_state_from"] == 0 and row["discarded_steps"] == 0
    assert members[1].sent[3][1] == 2.0 and row["tokens"] == 4 * TOKENS  # round 3: both rounds' steps
    assert outers[1].summary()["discarded_steps"] == 0


class Gate(Lone):
    """A lone member that, in round `at`, first runs `meanwhile` on a thread of its own, and closes its round (alone)
    only once `entered` is set: another group's round began meanwhile and found nobody."""

    def __init__(self, hub: MemorySwarm, name: str, at: int) -> None:
        super().__init__(hub, name)
        self.at, self.entered = at, threading.Event()
        self.meanwhile: Callable[[], object] = lambda: None
        self.thread: threading.Thread | None = None

    def average(self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: object,
                fragment: object = None, outer_step: int | None = None, last: bool = False) -> Report:  # fmt: skip
        if round_index == self.at:
            self.thread = threading.Thread(target=self.meanwhile)
            self.thread.start()
            assert self.entered.wait(10)
        return super().average(tensors, round_index, weight, stop, fragment, outer_step, last)


class Entering(Lone):
    """A lone member that says when it enters a round."""

    def __init__(self, hub: MemorySwarm, name: str, entered: threading.Event) -> None:
        super().__init__(hub, name)
        self.entered = entered

    def average(self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: object,
                fragment: object = None, outer_step: int | None = None, last: bool = False) -> Report:  # fmt: skip
        self.entered.set()
        return super().average(tensors, round_index, weight, stop, fragment, outer_step, last)


def test_a_group_that_missed_the_round_it_loaded_into_loads_its_result_as_it_lands_and_is_not_behind_next() -> None:
    """Group 1 loads the state group 0 serves while group 0 is in round 2 (outer step 1, inner step 4) and joins that
    round, which formed without it. Rather than come to round 3 an outer step behind (download again, and maybe miss
    that round as well: round after round when rounds are on the wire), it waits for group 0 to land round 2 and
    loads the result at once."""
    hub = MemorySwarm(2)
    gate = Gate(hub, "g0", at=2)
    members = {0: gate, 1: Entering(hub, "g1", gate.entered)}
    nets = {g: net() for g in (0, 1)}
    outers = {g: diloco(nets[g], members[g], lr=0.7, momentum=0.0, h=2, world_rank=g, tokens_per_step=TOKENS,
                        final_step=10, land_wait=5.0) for g in (0, 1)}  # fmt: skip
    for g in (0, 1):
        outers[g].join(0)
    train({0: outers[0]}, {0: nets[0]}, range(0, 2))  # round 1: group 0 alone
    late: list[dict] = []
    gate.meanwhile = lambda: late.extend(train({1: outers[1]}, {1: nets[1]}, range(0, 2))[1])
    train({0: outers[0]}, {0: nets[0]}, range(2, 4))  # round 2, during which group 1 comes
    assert gate.thread is not None
    gate.thread.join(10)
    missed, reloaded = late
    assert missed["loaded_state_from"] == 0 and missed["outer_step"] == 1 and missed["num_peers"] == 1
    assert reloaded["loaded_state_from"] == 0 and reloaded["outer_step"] == 2 and reloaded["step"] == 4
    assert outers[1].outer_step == outers[0].outer_step == 2 and torch.equal(outers[1].outer, outers[0].outer)
    assert not [r for holders in outers[1]._plan() for r in holders if r.outer_step > 2]  # not behind at round 3



class OnTheWire(Member):
    """A member that averages alone until round `at`; in that round, on the round's own thread (rounds overlap the
    inner steps), it first starts `meanwhile` on a thread of its own, then meets the others as any member does."""

    def __init__(self, hub: MemorySwarm, name: str, at: int) -> None:
        super().__init__(hub, name)
        self.at, self.thread = at, None
        self.meanwhile: Callable[[], object] = lambda: None

    def average(self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: object,
                fragment: object = None, outer_step: int | None = None, last: bool = False) -> Report:  # fmt: skip
        if round_index < self.at:
            return Report(num_peers=1)
        if round_index == self.at:
            self.thread = threading.Thread(target=self.meanwhile)
            self.thread.start()
        return super().average(tensors, round_index, weight, stop, fragment, outer_step, last)


def test_a_group_behind_that_loads_from_a_group_with_a_round_on_the_wire_joins_that_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rounds overlap one inner step. Group 0 took round 1 alone and has round 2 (boundary 4) on the wire while it
    takes inner step 5; the state it serves is from before round 2. Group 1, behind at its boundary 2, loads it and
    goes to step 4, the round's boundary, not to step 5: there it joins round 2 (with no weight: its steps were
    dropped), and both groups apply it. At step 5 it would be out of that round, and an outer step behind at its next
    boundary, where the same happens again."""
    caplog.set_level(logging.INFO, logger="diloco")
    hub = MemorySwarm(2)
    hub.barrier = threading.Barrier(2, timeout=10)  # (a round nobody joins fails the test instead of hanging it)
    wire = OnTheWire(hub, "g0", at=2)
    members = {0: wire, 1: hub.member("g1")}
    nets = {g: net() for g in (0, 1)}
    outers = {g: diloco(nets[g], members[g], lr=0.7, momentum=0.0, h=2, world_rank=g, tokens_per_step=TOKENS,
                        final_step=10, overlap_steps=1) for g in (0, 1)}  # fmt: skip
    for g in (0, 1):
        outers[g].join(0)
    late: list[dict] = []

    def group_1_comes() -> None:
        deadline = time.monotonic() + 10
        while outers[0].step < 5 and time.monotonic() < deadline:  # group 0 serves inner step 5, round 2 unlanded
            time.sleep(0.01)
        late.extend(train({1: outers[1]}, {1: nets[1]}, range(0, 2))[1])

    wire.meanwhile = group_1_comes
    landed = train({0: outers[0]}, {0: nets[0]}, range(0, 5))[0]  # rounds 1 (alone) and 2, landing at step 5
    assert wire.thread is not None
    wire.thread.join(10)
    [joined] = late
    assert joined["loaded_state_from"] == 0 and joined["step"] == 4 and joined["num_peers"] == 2
    assert outers[1].loaded_step == 4 and outers[1].step == 4
    assert "outer step 1, inner step 5 (its round of inner step 4 on the wire)" in caplog.text  # (the load's line)
    assert [row["num_peers"] for row in landed] == [1, 2] and landed[-1]["round_step"] == 4
    assert outers[1].outer_step == outers[0].outer_step == 2 and torch.equal(outers[1].outer, outers[0].outer)

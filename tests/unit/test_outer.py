"""The outer step's arithmetic, against hand computation, and the outer loop's membership (joining, catching
up, settling), with the in-memory swarm across threads."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from diloco.cli.app import as_flags
from diloco.errors import FieldError
from diloco.outer.catchup import Refused, sources
from diloco.outer.diloco import DiLoCo, JoinError
from diloco.outer.links import solo_group
from diloco.outer.loop import OuterReport
from diloco.outer.memory import Member, MemorySwarm, Report
from diloco.swarm.records.progress import Progress
from diloco.swarm.rounds.group_round import abreast
from tests.support.outer import diloco


def approx(value: float) -> object:
    return pytest.approx(value, rel=1e-6, abs=1e-7)


class Alone(Member):
    def __init__(self) -> None:
        super().__init__(MemorySwarm(1), "alone")

    def average(
        self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: object, fragment: object = None,
        outer_step: int | None = None,
        last: bool = False,
    ) -> Report:
        return Report(num_peers=1)


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batches(step: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + group)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def sgd_step(net: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(batch[0]), batch[1]).backward()
    opt.step()


def test_h1_outer_lr1_no_momentum_equals_data_parallel_sgd() -> None:
    """With H=1, inner SGD, outer lr 1 and no momentum, k groups take exactly the data-parallel SGD steps."""
    k, steps, lr = 3, 5, 0.1
    reference = model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    for step in range(steps):  # data-parallel: the gradient of the mean loss over all k batches
        ref_opt.zero_grad()
        for group in range(k):
            x, y = batches(step, group)
            (torch.nn.functional.mse_loss(reference(x), y) / k).backward()
        ref_opt.step()

    hub = MemorySwarm(k)
    nets = [model() for _ in range(k)]

    def run_group(group: int) -> None:
        net = nets[group]
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        outer = diloco(net, hub.member(f"g{group}"), lr=1.0, momentum=0.0, world_rank=group)
        for step in range(steps):
            sgd_step(net, opt, batches(step, group))
            row = outer.after_inner_step(step + 1).row
            assert row["num_peers"] == k and row["outer_step"] == step + 1

    with ThreadPoolExecutor(k) as pool:
        list(pool.map(run_group, range(k)))
    for net in nets:
        for p, q in zip(net.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(p, q) for p, q in zip(nets[0].parameters(), nets[1].parameters()))


def test_nesterov_outer_step_by_hand() -> None:
    """Alone, two outer steps of SGD with Nesterov momentum m: v = m·v + Δ; θ ← θ − lr·(Δ + m·v)."""
    net = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        net.weight.fill_(1.0)
    outer = diloco(net, Alone(), lr=0.5, momentum=0.9, h=2)
    theta, velocity = 1.0, 0.0
    for new_local in (0.8, None):
        with torch.no_grad():
            net.weight.fill_(new_local if new_local is not None else theta - 0.3)
        delta = theta - net.weight.item()
        assert outer.after_inner_step(1) is None  # not due yet: H = 2
        row = outer.after_inner_step(2).row
        velocity = 0.9 * velocity + delta
        theta -= 0.5 * (delta + 0.9 * velocity)
        assert row["num_peers"] == 1 and row["pseudo_grad_norm"] == approx(abs(delta))
        assert net.weight.item() == approx(theta)  # the model was reset to the new outer parameters
    state = outer.state_dict()
    assert state["outer_step"] == 2 and state["outer"].item() == approx(theta)


def test_outer_lr_warmup_by_hand_and_after_a_state_download() -> None:
    """With warm-up 3 and lr 1.5 the outer steps take lr 0.5, 1.0, 1.5, 1.5 (plain SGD: θ ← θ − lr·Δ). A group
    that loads the state after step 2 takes step 3 at 1.5 like the rest: the warm-up follows the shared outer
    step, not the group's own count."""
    net = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        net.weight.fill_(1.0)
    outer = diloco(net, Alone(), lr=1.5, momentum=0.0, outer_warmup=3)
    theta = 1.0
    for step, lr in enumerate((0.5, 1.0, 1.5, 1.5), start=1):
        with torch.no_grad():
            net.weight.sub_(0.2)  # the inner steps moved the weight by −0.2: Δ = 0.2
        outer.after_inner_step(step)
        theta -= lr * 0.2
        assert net.weight.item() == approx(theta), step
        if step == 2:  # (the state's tensors are the live ones: a checkpoint writes them at once)
            state = copy.deepcopy(outer.params.state_dict())
    late = torch.nn.Linear(1, 1, bias=False)
    joiner = diloco(late, Alone(), lr=1.5, momentum=0.0, outer_warmup=3)
    joiner.params.load_state_dict(state)
    theta = state["outer"].item()
    with torch.no_grad():
        late.weight.fill_(theta - 0.2)
    joiner.after_inner_step(3)
    assert late.weight.item() == approx(theta - 1.5 * 0.2)


def test_state_round_trip_restores_momentum() -> None:
    a, b = model(1), model(2)
    outer_a = diloco(a, Alone(), lr=0.7, momentum=0.9)
    with torch.no_grad():
        for p in a.parameters():
            p.add_(0.01)
    outer_a.after_inner_step(1)
    outer_b = diloco(b, Alone(), lr=0.7, momentum=0.9)
    outer_b.load_state_dict(outer_a.state_dict())
    assert torch.equal(outer_b.outer, outer_a.outer) and outer_b.outer_step == 1
    assert torch.equal(
        outer_b.optimizer.state_dict()["state"][0]["momentum_buffer"],
        outer_a.optimizer.state_dict()["state"][0]["momentum_buffer"],
    )


# ---------------------------------------------------------------- catching up with the swarm


def train_phase(outers: dict[int, DiLoCo], nets: dict[int, torch.nn.Module], steps: range) -> dict[int, list]:
    """Each group takes SGD steps on its own batches and calls the outer loop, in its own thread."""
    rows: dict[int, list] = {g: [] for g in outers}

    def run_group(group: int) -> None:
        opt = torch.optim.SGD(nets[group].parameters(), lr=0.05)
        for step in steps:
            sgd_step(nets[group], opt, batches(step, group))
            report = outers[group].after_inner_step(step + 1)
            if report is not None:
                rows[group].append(report.row)

    with ThreadPoolExecutor(len(outers)) as pool:
        list(pool.map(run_group, outers))
    return rows


def params(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def test_late_joiner_loads_the_outer_state_and_is_identical_after_the_next_round() -> None:
    hub = MemorySwarm(2)
    nets = {g: model(0) for g in (0, 1)}
    outers = {g: diloco(nets[g], hub.member(f"g{g}"), lr=0.7, momentum=0.9, h=2, world_rank=g) for g in (0, 1)}
    # the same initial state: nothing to load
    assert [outers[g].join(0) for g in (0, 1)] == [OuterReport(0), OuterReport(0)]
    train_phase(outers, nets, range(0, 6))  # three outer steps

    nets[2] = model(7)  # another initialisation: it must not leak into the swarm
    outers[2] = diloco(nets[2], hub.member("g2"), lr=0.7, momentum=0.9, h=2, world_rank=2)
    assert outers[2].join(0) == OuterReport(6)  # the inner step count comes with the state: the LR schedule lines up
    joined, source = outers[2], outers[0]
    assert joined.loaded_from_peers and joined.outer_step == 3 and torch.equal(joined.outer, source.outer)
    assert torch.equal(
        joined.optimizer.state[joined.outer]["momentum_buffer"], source.optimizer.state[source.outer]["momentum_buffer"]
    )
    assert torch.equal(params(nets[2]), source.outer)  # the model starts from the swarm's outer parameters

    hub.barrier = threading.Barrier(3)
    rows = train_phase(outers, nets, range(6, 8))
    assert all(r[-1]["num_peers"] == 3 and r[-1]["outer_step"] == 4 for r in rows.values())
    assert torch.equal(params(nets[0]), params(nets[1])) and torch.equal(params(nets[0]), params(nets[2]))
    assert outers[0].downloads == outers[1].downloads == 0  # the fresh group never overwrote the trained ones


class FailsOnce(Member):
    """A member whose round `fail_round` (default: its first) fails on its side only; the others' succeeds."""

    def __init__(self, hub: MemorySwarm, name: str, fail_round: int | None = None) -> None:
        super().__init__(hub, name)
        self.fail_round, self.failed = fail_round, False

    def average(
        self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: object, fragment: object = None,
        outer_step: int | None = None,
        last: bool = False,
    ) -> Report:
        inputs = [t.clone() for t in tensors]
        report = super().average(tensors, round_index, weight, stop, fragment, outer_step, last)
        if not self.failed and self.fail_round in (None, round_index):
            self.failed = True
            for tensor, kept in zip(tensors, inputs):
                tensor.copy_(kept)  # a failed round leaves the tensors as they were
            return Report(num_peers=0, ok=False)
        return report


def joined_pair(hub: MemorySwarm, second: Member) -> tuple[dict[int, torch.nn.Module], dict[int, DiLoCo]]:
    """Group 0 (a plain member of `hub`) and group 1 (`second`), from one initialisation, H = 1, joined."""
    nets = {g: model(0) for g in (0, 1)}
    members = {0: hub.member("g0"), 1: second}
    outers = {g: diloco(nets[g], members[g], lr=0.7, momentum=0.9, h=1, world_rank=g) for g in (0, 1)}
    for g in (0, 1):
        outers[g].join(0)
    return nets, outers


def test_group_whose_round_failed_reloads_the_swarm_state_at_the_next_round() -> None:
    hub = MemorySwarm(2)
    nets, outers = joined_pair(hub, FailsOnce(hub, "g1"))
    rows = train_phase(outers, nets, range(0, 1))
    assert (outers[0].outer_step, outers[1].outer_step) == (1, 0)  # the failed group applied nothing
    assert rows[1][-1]["num_peers"] == 0 and not torch.equal(outers[0].outer, outers[1].outer)
    outers[0].step = 0  # as if group 0 had not reached the next boundary when group 1 downloads its state
    assert outers[1]._load_from(outers[1]._plan()) == 1  # group 1 keeps its own inner step, never goes back
    outers[1].load_state_dict({"outer": outers[1].outer.clone(), "optimizer": outers[1].optimizer.state_dict(),
                               "outer_step": 0})  # undo that load: the round below loads again  # fmt: skip
    rows = train_phase(outers, nets, range(1, 2))
    assert rows[1][-1]["loaded_state_from"] == 0 and "loaded_state_from" not in rows[0][-1]
    assert torch.equal(outers[0].outer, outers[1].outer) and torch.equal(params(nets[0]), params(nets[1]))


class LateRecords(FailsOnce):
    """FailsOnce whose reads of the progress records can come back stale: while `stale`, the others' records are
    the ones stored before its failed round (a DHT read that lags a store, as under load)."""

    def __init__(self, hub: MemorySwarm, name: str) -> None:
        super().__init__(hub, name)
        self.stale, self.before = False, list(hub.records.values())

    def records(self) -> list[Progress]:
        mine = [r for r in super().records() if r.owner == self.owner]
        return mine + [r for r in self.before if r.owner != self.owner] if self.stale else super().records()


def test_a_group_behind_that_cannot_see_it_sits_the_swarms_round_out() -> None:
    """Group 1's round fails on its side and, at the next boundary, its read of the records still shows group 0 where
    it was: it comes to the round an outer step behind. It sits the round out (applies nothing, mixes nothing in),
    and group 0's round is its own; at the boundary after, group 1 loads group 0's state and the two are one model
    again. Mixed in, the two would have named one round and held different models after it (CI's churn soak)."""
    hub = MemorySwarm(2)
    late = LateRecords(hub, "g1")
    nets, outers = joined_pair(hub, late)
    late.before = list(hub.records.values())
    train_phase(outers, nets, range(0, 1))
    assert (outers[0].outer_step, outers[1].outer_step) == (1, 0)  # round 1 failed on group 1's side only
    late.stale = True
    outer_1 = outers[1].outer.clone()
    stale = train_phase(outers, nets, range(1, 2))
    assert [stale[g][-1]["num_peers"] for g in (0, 1)] == [1, 0] and "loaded_state_from" not in stale[1][-1]
    assert stale[1][-1]["sat_out"] is True and "sat_out" not in stale[0][-1]
    assert outers[1].outer_step == 0 and torch.equal(outers[1].outer, outer_1)  # it applied nothing
    late.stale = False
    rows = train_phase(outers, nets, range(2, 3))
    assert rows[1][-1]["loaded_state_from"] == 0 and [rows[g][-1]["num_peers"] for g in (0, 1)] == [2, 2]
    assert rows[0][-1]["outer_digest"] == rows[1][-1]["outer_digest"] and rows[0][-1]["round"]
    assert torch.equal(outers[0].outer, outers[1].outer) and torch.equal(params(nets[0]), params(nets[1]))


def test_the_groups_abreast_are_those_at_the_highest_outer_step_below_the_round() -> None:
    assert abreast([4, 4, 3], round_index=5) == [0, 1]  # the group behind sits out
    assert abreast([3, None, 4], round_index=5) == [1, 2]  # an older version (no field) is not sent out
    assert abreast([4, 10**6, 4], round_index=5) == [0, 1, 2]  # no group holds round 5's step yet: counts as none
    assert abreast([4, True, "4", -1], round_index=5) == [0, 1, 2, 3]  # not an outer step: as none
    assert abreast([None, None], round_index=1) == [0, 1] and abreast([], 1) == []


def finish_all(outers: dict[int, DiLoCo]) -> dict[int, dict | None]:
    with ThreadPoolExecutor(len(outers)) as pool:
        return dict(zip(outers, pool.map(lambda g: outers[g].finish(), outers)))


def test_torn_last_round_the_failed_group_downloads_the_result_before_it_exports() -> None:
    hub = MemorySwarm(2)
    nets = {g: model(0) for g in (0, 1)}
    members = {0: hub.member("g0"), 1: FailsOnce(hub, "g1", fail_round=3)}
    outers = {g: diloco(nets[g], members[g], 0.7, 0.9, h=2, world_rank=g, final_step=6) for g in (0, 1)}
    for g in (0, 1):
        outers[g].join(0)
    train_phase(outers, nets, range(0, 6))
    assert (outers[0].outer_step, outers[1].outer_step) == (3, 2)  # the last round failed on group 1's side
    rows = finish_all(outers)
    assert rows[0] is None and rows[1]["loaded_state_from"] == 0 and rows[1]["outer_step"] == 3
    assert torch.equal(params(nets[0]), params(nets[1])) and torch.equal(params(nets[1]), outers[0].outer)


def test_a_last_step_off_the_h_grid_ends_with_a_shorter_round() -> None:
    hub = MemorySwarm(2)
    nets = {g: model(0) for g in (0, 1)}
    outers = {g: diloco(nets[g], hub.member(f"g{g}"), 0.7, 0.9, h=3, world_rank=g, final_step=5) for g in (0, 1)}
    rows = train_phase(outers, nets, range(0, 5))
    assert [[r["step"] for r in rows[g]] for g in (0, 1)] == [[3, 5], [3, 5]]  # 5 % 3 != 0: a round all the same
    assert all(r["num_peers"] == 2 for g in (0, 1) for r in rows[g])
    assert finish_all(outers) == {0: None, 1: None}  # nothing left to settle
    assert torch.equal(params(nets[0]), params(nets[1])) and torch.equal(params(nets[0]), outers[0].outer)


class AlwaysFails(Member):
    def average(
        self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: object, fragment: object = None,
        outer_step: int | None = None,
        last: bool = False,
    ) -> Report:
        return Report(num_peers=0, ok=False)


def test_when_the_last_round_failed_everywhere_every_group_exports_the_outer_parameters() -> None:
    hub = MemorySwarm(2)
    nets = {g: model(0) for g in (0, 1)}
    outers = {g: diloco(nets[g], AlwaysFails(hub, f"g{g}"), 0.7, 0.9, h=2, world_rank=g, final_step=2) for g in (0, 1)}
    for g in (0, 1):
        outers[g].join(0)
    train_phase(outers, nets, range(0, 2))
    assert not torch.equal(params(nets[0]), params(nets[1]))  # each kept its own inner steps
    rows = finish_all(outers)
    assert rows[0]["outer_step"] == rows[1]["outer_step"] == 0
    assert torch.equal(params(nets[0]), params(nets[1])) and torch.equal(params(nets[0]), outers[0].outer)
    # the two inner steps of each group were thrown away, and every place that reports it says so
    assert [rows[g]["discarded_steps"] for g in (0, 1)] == [2, 2]
    assert [outers[g].summary()["discarded_steps"] for g in (0, 1)] == [2, 2]


def test_a_finished_group_waits_a_bounded_time_for_a_live_group_still_training() -> None:
    hub = MemorySwarm(1)
    nets = {g: model(0) for g in (0, 1)}
    outers = {g: diloco(nets[g], hub.member(f"g{g}"), 0.7, 0.9, world_rank=g, settle_timeout=1.0) for g in (0, 1)}
    for g in (0, 1):
        outers[g].join(0)
    started = time.monotonic()
    assert outers[0].finish() is None  # group 1 never finishes: group 0 waits settle_timeout, then exports
    assert 1.0 <= time.monotonic() - started < 3.0
    assert hub.records["g0", 0].done and not hub.records["g1", 1].done  # (by owner and world rank)


class Unreachable(Member):
    def download_state(self, record: Progress, rank: int, wanted: object = None) -> None:
        return None


def test_joiner_never_starts_alone_while_a_live_peer_holds_the_state() -> None:
    hub = MemorySwarm(1)
    first = diloco(model(0), hub.member("g0"), lr=0.7, momentum=0.9, world_rank=0)
    first.join(0)
    joiner = DiLoCo(
        [p.data for p in model(3).parameters()], Unreachable(hub, "g1"), solo_group(), world_rank=1,
        local_steps=1, outer_lr=0.7, outer_momentum=0.9, join_timeout=1.5,
    )  # fmt: skip
    with pytest.raises(JoinError, match="could not download the swarm's state"):
        joiner.join(0)


class Vanishing(Unreachable):
    """The first look at the swarm shows a group ahead (whose state does not download); later looks show nothing,
    as when a DHT read comes back empty under load."""

    looks = 0

    def records(self) -> list[Progress]:
        self.looks += 1
        return super().records() if self.looks == 1 else []


def test_a_joiner_that_saw_a_group_ahead_never_starts_alone_when_it_vanishes() -> None:
    hub = MemorySwarm(1)
    first = diloco(model(0), hub.member("g0"), lr=0.7, momentum=0.9, world_rank=0)
    first.join(0)
    swarm = Vanishing(hub, "g1")
    joiner = DiLoCo(
        [p.data for p in model(3).parameters()], swarm, solo_group(), world_rank=1,
        local_steps=1, outer_lr=0.7, outer_momentum=0.9, join_timeout=1.5,
    )  # fmt: skip
    with pytest.raises(JoinError, match="from 1 live worker group"):
        joiner.join(0)
    assert swarm.looks >= 3  # it kept looking after the group vanished


def test_a_second_group_with_a_taken_world_rank_leaves() -> None:
    hub = MemorySwarm(1)
    running = diloco(model(0), hub.member("g0"), lr=0.7, momentum=0.0, world_rank=4)
    running.claim_world_rank()
    running.join(0)
    rival = diloco(model(0), hub.member("g0-again"), lr=0.7, momentum=0.0, world_rank=4)
    with pytest.raises(FieldError) as taken:
        rival.claim_world_rank()
    assert str(as_flags(taken.value.within("hv"))).startswith("--hv.world-rank 4 is taken")  # as training says it
    running.close()  # once the first is gone, the world rank is free again (a restarted group)
    rival.claim_world_rank()


def record(world_rank: int, outer_step: int, digest: str, *, tainted: bool = False, settled: bool = True) -> Progress:
    token, peers = f"t{world_rank}", (f"p{world_rank}",)
    return Progress(world_rank, outer_step, outer_step * 10, digest, tainted, settled, token, peers)


@pytest.mark.parametrize(
    ("others", "mine", "expected"),
    [
        ([record(1, 5, "a")], record(0, 4, "z"), [[1]]),  # behind: load the newer state
        ([record(1, 5, "a")], record(0, 5, "a"), []),  # same state: nothing to do
        ([record(1, 5, "a")], record(0, 5, "b", tainted=True), [[1]]),  # a full average beats a failed round
        ([record(1, 5, "a", tainted=True)], record(0, 5, "b"), []),  # ... also the other way round
        ([record(1, 5, "a"), record(2, 5, "a")], record(0, 5, "b"), [[1, 2]]),  # more holders
        ([record(1, 5, "a")], record(2, 5, "b"), [[1]]),  # a tie goes to the lowest world rank
        ([record(1, 5, "a")], record(0, 5, "b"), []),
        ([record(1, 9, "a", settled=False)], record(0, 5, "b"), []),  # not joined yet: never a source
        ([record(3, 9, "dead"), record(1, 7, "a")], record(0, 5, "b"), [[1]]),  # dead groups are skipped
    ],
)
def test_sources_rank_states(others: list[Progress], mine: Progress, expected: list[list[int]]) -> None:
    plan = sources(others, mine, alive=lambda r: r.digest != "dead")
    assert [[r.world_rank for r in holders] for holders in plan] == expected


def test_a_state_held_only_by_groups_nobody_can_dial_is_not_planned_and_the_next_best_is() -> None:
    """A group behind a router names its shape but no endpoints (``Progress.serves``): nobody tries to download from
    it, and a state only such groups hold gives way to the next best one."""
    behind = dataclasses.replace(record(1, 9, "a"), shape=("FULL_SHARD", 1, 1), endpoints=())
    public = dataclasses.replace(record(2, 7, "c"), shape=("FULL_SHARD", 1, 1), endpoints=([["10.0.0.2"], 5],))
    assert not behind.serves and public.serves and record(3, 1, "m").serves  # (the in-memory swarm names neither)
    plan = sources([behind, public], record(0, 5, "b"), alive=lambda r: True)
    assert [[r.world_rank for r in holders] for holders in plan] == [[2]]
    alike = dataclasses.replace(public, outer_step=9, digest="a")  # a public group holding the same state serves it
    plan = sources([behind, alike], record(0, 5, "b"), alive=lambda r: True)
    assert [[r.world_rank for r in holders] for holders in plan] == [[2]]


def test_a_state_refused_too_often_is_pruned_until_its_group_moves_on() -> None:
    """A forged record (a stranger claiming outer step 10**6): after three refused answers its state leaves the plan
    and the next source is first; the same group at a new state, or another start of it, is asked again."""
    forged, honest = record(2, 10**6, "f"), record(1, 7, "a")
    plan = sources([forged, honest], record(0, 5, "b"), alive=lambda r: True)
    refused = Refused(limit=3)
    for _ in range(2):
        refused.note(forged)
    assert [[r.world_rank for r in holders] for holders in refused.prune(plan)] == [[2], [1]]
    refused.note(forged)
    assert refused.skipped(forged) and [[r.world_rank for r in h] for h in refused.prune(plan)] == [[1]]
    moved = dataclasses.replace(forged, outer_step=10**6 + 1)
    restarted = dataclasses.replace(forged, token="another start")
    assert not refused.skipped(moved) and not refused.skipped(restarted) and not refused.skipped(honest)

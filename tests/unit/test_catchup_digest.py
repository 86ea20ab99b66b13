"""A downloaded state is taken only when it is the one its source's owner signed (`diloco.outer.catchup`): the outer
step and digest of the source's progress record, which `sources` ranked it by, not what the source says of it when
asked. A stranger serving a self-consistent state of its own under another's digest is refused and counted; honest
sources, and an honest source whose record lags its state by an outer step, are taken (the latter on the next try,
uncounted)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from diloco.outer.catchup import REFUSALS_BEFORE_SKIP, CatchUp
from diloco.outer.links import State, solo_group
from diloco.outer.memory import Member, MemorySwarm
from diloco.outer.optimizer import OuterOptimizer
from diloco.swarm.records.progress import Progress
from diloco.swarm.rounds.digest import CanonicalDigest
from diloco.swarm.rounds.layout import Shape, group_layout
from tests.support.outer import diloco

SHAPES = [(4, 8), (8,)]  # a wide-row matrix and a bias: 40 values
NUMEL = 40


class Served:
    """A swarm whose groups answer state downloads with what `answers` holds for their token."""

    rejected_states = 0  # (the transfer's refusals: none in memory)

    def __init__(self, answers: dict[str, State]) -> None:
        self.answers = answers

    def download_state(self, record: Progress, rank: int, wanted: Any = None) -> State | None:
        got = self.answers.get(record.token)
        if got is not None and wanted is not None and not wanted(got[0]):
            return got[0], []  # cut after its metadata, as ``transfer.download`` cuts it
        return got

    def alive(self, peer_id: str) -> bool:
        return True


DIGEST = CanonicalDigest(SHAPES, group_layout(SHAPES, Shape("FULL_SHARD", 1))[0])


def digest_of(values: torch.Tensor) -> str:
    return DIGEST.combine([DIGEST.partial(values)])


def served(values: torch.Tensor, outer_step: int, digest: str | None = None) -> State:
    """A state as a group serves it: its metadata (by default with the values' own digest) and its tensors."""
    meta = {"outer_step": outer_step, "step": 10 * outer_step, "digest": digest or digest_of(values),
            "tainted": False, "world_rank": 1}  # fmt: skip
    return meta, [values.clone()]


def record(world_rank: int, outer_step: int, digest: str, token: str) -> Progress:
    return Progress(world_rank=world_rank, outer_step=outer_step, step=10 * outer_step, digest=digest, tainted=False,
                    settled=True, token=token, peers=(f"p{world_rank}",))  # fmt: skip


def catch_up(answers: dict[str, State]) -> CatchUp:
    params = OuterOptimizer([torch.zeros(NUMEL)], lr=1.0, momentum=0.0)
    return CatchUp(Served(answers), solo_group(), params, DIGEST)  # type: ignore[arg-type]


def test_an_honest_source_is_taken() -> None:
    values = torch.randn(NUMEL)
    signed = record(1, 7, digest_of(values), "honest")
    catch = catch_up({"honest": served(values, 7)})
    found = catch.fetch([[signed]])
    assert found is not None and found[0] == signed and torch.equal(found[2][0], values)
    assert catch.rejected_states == 0


@pytest.mark.parametrize(
    "answer",
    ["another state", "the same values at another outer step", "another state at another outer step"],
)
def test_a_self_consistent_state_other_than_the_record_names_is_refused_and_counted(answer: str) -> None:
    """The record names outer step 7 and the digest of `values` (a stranger can copy both from an honest group's
    record); the answer is a state whose values add up to the digest it is served with, but not the record's."""
    values = torch.randn(NUMEL)
    signed = record(1, 7, digest_of(values), "stranger")
    answers = {"another state": served(values * -3.0, 7), "the same values at another outer step": served(values, 9),
               "another state at another outer step": served(values + 1.0, 10**6)}  # fmt: skip
    catch = catch_up({"stranger": answers[answer]})
    assert catch.fetch([[signed]]) is None
    assert catch.rejected_states == 1 and catch.refusals_here == 1
    for _ in range(REFUSALS_BEFORE_SKIP - 1):
        assert catch.fetch([[signed]]) is None
    assert catch.refused.skipped(signed) and catch.plan(record(0, 0, "mine", "mine"), [signed]) == []


def test_after_a_stranger_serving_a_forged_state_under_the_honest_digest_the_honest_holder_is_taken() -> None:
    """A stranger's record copies an honest group's state (outer step and digest) under a lower world rank, so it is
    asked first; it serves a forged state with a digest of its own. The group refuses it and loads the honest one."""
    values = torch.randn(NUMEL)
    honest = record(2, 7, digest_of(values), "honest")
    stranger = dataclasses.replace(honest, world_rank=1, token="stranger", peers=("p1",))
    catch = catch_up({"stranger": served(values * 0.5, 7), "honest": served(values, 7)})
    found = catch.fetch(catch.plan(record(0, 3, "mine", "mine"), [stranger, honest]))
    assert found is not None and found[0] == honest and torch.equal(found[2][0], values)
    assert catch.rejected_states == 1


def test_a_record_that_lags_its_groups_state_is_refused_once_then_its_next_record_is_taken() -> None:
    """The source took an outer step after this group read its record: the state it serves is one outer step newer
    than the one its record names. Not taken this time (no record vouches for it yet), nor counted as refused (an
    honest race, not a forgery); its next record names it and is taken."""
    before, after = torch.randn(NUMEL), torch.randn(NUMEL)
    old = record(1, 7, digest_of(before), "source")
    catch = catch_up({"source": served(after, 8)})
    assert catch.fetch([[old]]) is None and catch.rejected_states == 0 and catch.refusals_here == 0
    new = dataclasses.replace(old, outer_step=8, digest=digest_of(after))
    found = catch.fetch(catch.plan(record(0, 0, "mine", "mine"), [new]))
    assert found is not None and found[0] == new and not catch.refused.skipped(new)


# ------------------------------------------------------------------ with the outer loop, in the in-memory swarm


def trained(hub: MemorySwarm, outer_steps: int) -> tuple[torch.nn.Module, Any]:
    """Group 0 alone in `hub`, `outer_steps` outer steps after joining (its parameters moved before each)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    first = diloco(net, hub.member("g0"), lr=0.7, momentum=0.0, world_rank=0)
    first.join(0)
    for step in range(1, outer_steps + 1):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.1 * step)
        first.after_inner_step(step)
    return net, first


def joiner(swarm: Member) -> Any:
    torch.manual_seed(3)
    return diloco(torch.nn.Linear(4, 2), swarm, lr=0.7, momentum=0.0, world_rank=1, join_timeout=10.0)


def test_a_joining_group_refuses_a_strangers_record_of_a_higher_outer_step_over_a_forged_state() -> None:
    """A stranger publishes a settled record claiming outer step 10**6 with the running group's digest and serves a
    state of its own (self-consistent metadata). The joining group refuses it and loads the running group's state."""
    hub = MemorySwarm(1)
    _, first = trained(hub, 2)
    forged = [torch.full_like(first.outer, 1e3)]
    meta = {"outer_step": 10**6, "step": 10**8, "digest": first.digester.combine([first.digester.partial(forged[0])]),
            "tainted": False, "world_rank": 5}  # fmt: skip
    hub.providers["stranger"] = lambda: (meta, [t.clone() for t in forged])
    hub.member("stranger").publish(dataclasses.replace(first._record(), world_rank=5, outer_step=10**6,
                                                       token="stranger", peers=("stranger",)))  # fmt: skip
    late = joiner(hub.member("g1"))
    late.join(0)
    assert late.outer_step == first.outer_step == 2 and torch.equal(late.outer, first.outer)
    assert late.loaded_from == 0 and late.summary()["rejected_states"] == 1


class Lagging(Member):
    """A member whose first look at the records comes before the source's last outer step (`old`), as when that
    step lands between this group's read of the records and its download."""

    def __init__(self, hub: MemorySwarm, name: str, old: list[Progress]) -> None:
        super().__init__(hub, name)
        self.old, self.looks = old, 0

    def records(self) -> list[Progress]:
        self.looks += 1
        return self.old if self.looks == 1 else super().records()


def test_a_joining_group_whose_source_moved_on_meanwhile_loads_its_state_on_the_next_look() -> None:
    hub = MemorySwarm(1)
    net, first = trained(hub, 1)
    old = list(hub.records.values())
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.5)
    first.after_inner_step(2)  # outer step 2: its state now differs from the record read first
    swarm = Lagging(hub, "g1", old)
    late = joiner(swarm)
    late.join(0)
    assert swarm.looks >= 2 and late.outer_step == 2 and torch.equal(late.outer, first.outer)
    assert late.summary()["rejected_states"] == 0  # a record behind its group's state is no forgery

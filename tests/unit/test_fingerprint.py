"""Model fingerprints: the same model (whatever its values) has one, any change of names, shapes or dtypes gives
another; a group whose model differs from the run's leaves at its start with one line naming both sides (in a keyed
swarm; in an open one it warns and trains on)."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import pytest
import torch

from diloco.errors import FieldError
from diloco.outer.agreement import (
    budget_of,
    budget_to_adopt,
    mismatch_error,
    rival_model,
    schedule,
    wire_format,
    with_budget,
)
from diloco.outer.diloco import PAUSE_MARGIN, DiLoCo
from diloco.outer.links import solo_group
from diloco.outer.memory import MemorySwarm
from diloco.swarm.records.fingerprint import ModelId, model_id
from diloco.swarm.records.status import Status


def net(width: int = 4, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, 2), torch.nn.Linear(2, 2)).to(dtype)


def test_the_fingerprint_sees_names_shapes_and_dtypes_not_values() -> None:
    base = model_id(net().named_parameters())
    assert base == model_id(net(seed=7).named_parameters())  # other values, same model
    assert base.parameters == 4 * 2 + 2 + 2 * 2 + 2 and re.fullmatch(r"[0-9a-f]{12}", base.fingerprint)
    renamed = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 2), "b": torch.nn.Linear(2, 2)})
    assert model_id(renamed.named_parameters()).parameters == base.parameters  # same count, other names
    others = [renamed, net(width=5), net(dtype=torch.float64)]
    fingerprints = {base.fingerprint, *(model_id(m.named_parameters()).fingerprint for m in others)}
    assert len(fingerprints) == 4
    assert str(base) == f"16 parameters, fingerprint {base.fingerprint}"


def status(world_rank: int, model: str, state: str = "training", heard_at: float = 100.0, **kw: Any) -> Status:
    fields = dict(world_rank=world_rank, ranks=1, sharding="FULL_SHARD", state=state, step=0, max_steps=10,
                  outer_step=0, tokens_per_s=None, digest="", round_peers=None, round_at=None, heard_at=heard_at,
                  model=model, parameters=14, peer=f"peer-{world_rank}")  # fmt: skip
    return Status(**fields | kw)


def test_the_rival_is_a_live_group_of_another_model_that_was_there_first() -> None:
    mine = status(1, "bbb", state="joining", heard_at=100.0)
    live = lambda peer: peer != "peer-9"  # noqa: E731
    assert rival_model(mine, [status(0, "aaa")], live).world_rank == 0
    assert rival_model(mine, [status(0, "bbb")], live) is None  # the same model
    older = status(0, "", peer="", parameters=None)  # a trainer from before fingerprints: other keys, no peer id
    assert rival_model(mine, [older], live) is older
    assert "runs a diloco from before model fingerprints" in str(mismatch_error(older, ModelId("bbb", 14)))
    assert rival_model(mine, [status(0, "aaa", state="finished")], live) is None  # it left
    assert rival_model(mine, [status(9, "aaa")], live) is None  # its peer does not answer: gone
    # two joining at once: the older record stays, the newer leaves (a tie: the lower world rank stays)
    assert rival_model(mine, [status(0, "aaa", state="joining", heard_at=101.0)], live) is None
    assert rival_model(mine, [status(0, "aaa", state="joining", heard_at=99.0)], live).world_rank == 0
    assert rival_model(mine, [status(0, "aaa", state="joining", heard_at=100.0)], live).world_rank == 0
    assert rival_model(status(0, "aaa", state="joining"), [status(1, "bbb", state="joining")], live) is None


def group(hub: MemorySwarm, world_rank: int, module: torch.nn.Module, transport: str = "tcp", **outer: Any) -> DiLoCo:
    shards = [p.data for p in module.parameters()]
    model = model_id(module.named_parameters())
    outer = {"outer_lr": 0.7, "outer_momentum": 0.0} | outer
    return DiLoCo(shards, hub.member(f"peer-{world_rank}"), solo_group(), world_rank=world_rank, local_steps=5,
                  final_step=30, model=model, transport=transport, claim_settle_s=0.0, **outer)  # fmt: skip


def test_a_group_of_another_model_leaves_with_one_line_naming_both() -> None:
    hub = MemorySwarm(2)
    first = group(hub, 0, net())
    first.claim_world_rank()
    first.join(0)
    group(hub, 2, net(seed=3)).claim_world_rank()  # the same model with other values is welcome
    other = group(hub, 1, net(width=5))
    with pytest.raises(FieldError) as refused:
        other.claim_world_rank()
    theirs, mine = model_id(net().named_parameters()), model_id(net(width=5).named_parameters())
    assert str(refused.value.within("hv")) == (
        f"hv.run_id: worker group 0 (peer peer-0) trains another model ({theirs}) than this group ({mine}); the "
        "groups of a run must train the same model: give this one the same model or another run id"
    )
    assert hub.statuses[0].model == theirs.fingerprint and hub.statuses[0].peer == "peer-0"


def test_in_an_open_swarm_a_status_record_of_another_model_gets_one_warning_and_the_group_trains_on() -> None:
    """In an open swarm anyone can publish a status record: a stranger's claiming another model (or setting), naming
    a live peer, must not stop a group. It warns once, naming the other group and what differs, and goes on; with a
    swarm key (`keyed`, the default) the same record is an operator's mistake and the group leaves."""
    hub = MemorySwarm(1)
    hub.statuses[5] = status(5, "aaa", parameters=99, peer="peer-5")  # the stranger's, naming a live peer
    hub.providers["peer-5"] = lambda: ({}, [])
    mine = group(hub, 0, net())
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = seen.append  # on the logger itself: another test's console set-up may stop propagation
    logging.getLogger("diloco").addHandler(handler)
    try:
        mine.claim_world_rank(keyed=False)
    finally:
        logging.getLogger("diloco").removeHandler(handler)
    warned = [r.getMessage() for r in seen if r.levelno == logging.WARNING]  # (its name may be WARN here)
    assert len(warned) == 1 and "worker group 5 (peer peer-5) trains another model" in warned[0], warned
    assert "training on" in warned[0]
    mine.join(0)
    assert hub.statuses[0].state == "training"  # it took its place in the swarm
    with pytest.raises(FieldError, match="worker group 5 .* trains another model"):
        group(hub, 1, net()).claim_world_rank()


def test_groups_of_any_transport_preference_share_a_run() -> None:
    """--hv.transport is a preference: a p2pd group joins a run of tcp groups (their ranks meet over TCP), and its
    record says its preference."""
    hub = MemorySwarm(2)
    first = group(hub, 0, net(), transport="tcp")
    first.claim_world_rank()
    first.join(0)
    group(hub, 1, net(seed=3), transport="p2pd").claim_world_rank()
    assert [hub.statuses[i].transport for i in (0, 1)] == ["tcp", "p2pd"]
    mine = status(1, "aaa", state="joining", transport="p2pd")
    assert rival_model(mine, [status(0, "aaa", transport="tcp")], lambda peer: True) is None


def test_a_group_of_another_outer_setting_leaves_with_one_line() -> None:
    """The same averaged pseudo-gradient stepped with another outer lr, momentum or warm-up would leave the groups
    on different outer parameters, so the later group leaves (e.g. auto picked another warm-up for it because its
    --warmup-steps differ); a record without the setting, from an earlier trainer, is not held against anyone."""
    hub = MemorySwarm(3)
    first = group(hub, 0, net(), outer_lr=1.2, outer_warmup=3)
    first.claim_world_rank()
    first.join(0)
    group(hub, 1, net(seed=3), outer_lr=1.2, outer_warmup=3).claim_world_rank()  # the same setting is welcome
    with pytest.raises(FieldError) as refused:
        group(hub, 2, net(seed=4), outer_lr=1.2, outer_warmup=6).claim_world_rank()
    assert str(refused.value.within("hv")) == (
        "hv.outer_lr: worker group 0 (peer peer-0) takes outer steps with lr/momentum and warm-up 1.2/0 w3, this "
        "group with 1.2/0 w6; the groups of a run must use one outer setting: give every group the same "
        "--hv.outer-lr, --hv.outer-momentum and --hv.outer-lr-warmup (auto picks them by H, galaxy size and "
        "--warmup-steps)"
    )
    assert hub.statuses[0].outer == "1.2/0 w3"
    mine = status(1, "aaa", state="joining", outer="1/0 w0")
    assert rival_model(mine, [status(0, "aaa", outer="")], lambda peer: True) is None


def test_a_group_of_another_aggregation_leaves_naming_the_flag() -> None:
    """A reducer with the mean would decide its spans as it likes in a swarm that trims: the later group leaves
    with a line naming --hv.aggregation, and its status record carries the rule."""
    hub = MemorySwarm(3)
    first = group(hub, 0, net(), outer_lr=1.2, aggregation="trimmed-mean")
    first.claim_world_rank()
    first.join(0)
    assert hub.statuses[0].outer == "1.2/0 w0 trimmed-mean"
    with pytest.raises(FieldError) as refused:
        group(hub, 1, net(seed=3), outer_lr=1.2).claim_world_rank()
    assert str(refused.value.within("hv")) == (
        "hv.aggregation mean: worker group 0 (peer peer-0) combines pseudo-gradients with trimmed-mean; the groups "
        "of a run must use one --hv.aggregation (a reducer with another rule decides the spans it reduces)"
    )


def test_a_group_of_another_wire_format_leaves_naming_the_flag() -> None:
    """A round between two wire formats fails at every connection's hello: the later group leaves at join with a line
    naming --hv.compression (with the sparse settings in words), not round after round. A record that says no wire
    format (a trainer from before it was said) is not held against anyone, and the default says none."""
    hub = MemorySwarm(3)
    sparse = wire_format("sparse", 1 / 64, 2, "sparseloco", 0.95)
    first = group(hub, 0, net(), outer_lr=1.0, wire=sparse)
    first.claim_world_rank()
    first.join(0)
    assert hub.statuses[0].outer == "1/0 w0 wire:sparse/0.015625/2/sparseloco/0.95"
    group(hub, 1, net(seed=3), outer_lr=1.0, wire=sparse).claim_world_rank()  # the same format is welcome
    with pytest.raises(FieldError) as refused:
        group(hub, 2, net(seed=4), outer_lr=1.0, wire=wire_format("sparse", 1 / 64, 4, "sparseloco", 0.95)
              ).claim_world_rank()  # fmt: skip
    assert str(refused.value.within("hv")) == (
        "hv.compression sparse (density 0.015625, 4 bits, sparseloco, error decay 0.95): worker group 0 (peer "
        "peer-0) sends its rounds as sparse (density 0.015625, 2 bits, sparseloco, error decay 0.95); the groups of "
        "a run must use one wire format: give every group the same --hv.compression (and with sparse, "
        "--hv.sparse-density, --hv.sparse-bits, --hv.sparse-rule and --hv.error-decay): a round between two "
        "formats fails"
    )
    assert wire_format("int8", 1 / 64, 2, "sparseloco", 0.95) == "int8"
    mine = status(1, "aaa", state="joining", outer="1/0 w0 wire:int8")
    assert rival_model(mine, [status(0, "aaa", outer="1/0 w0")], lambda peer: True) is None  # from before
    assert rival_model(mine, [status(0, "aaa", outer="1/0 w0 wire:fp16")], lambda peer: True) is not None
    other = status(0, "aaa", outer="1/0 w0 trimmed-mean wire:int8")  # the rule still read beside the format
    assert rival_model(mine, [other], lambda peer: True) is not None
    assert "--hv.aggregation" in str(mismatch_error(other, ModelId("aaa", 0), mine.outer))
    stranger = status(0, "aaa", outer="1/0 w0 wire:\x1b[2J" + "x" * 10_000)  # quoted printable and short
    line = str(mismatch_error(stranger, ModelId("aaa", 0), mine.outer))
    assert "\x1b" not in line and len(line) < 600, line


def test_the_schedule_names_what_sets_the_rounds_and_the_end() -> None:
    assert schedule(200, 25, None) == "200 steps, H 25"
    assert schedule(200, 25, (819200, 8), fragments=2, overlap_steps=1) == (
        "8 rounds of 819200 tokens, 2 fragments, 1 overlapped steps")
    assert schedule(None, 25, None) == "no last step, H 25"
    assert budget_of(schedule(200, 25, (819200, 8), 2)) == (819200, 8) and budget_of("200 steps, H 25") is None
    assert with_budget(schedule(200, 25, (100, 3), 2), (400, 9)) == "9 rounds of 400 tokens, 2 fragments"


@pytest.mark.parametrize(
    ("theirs", "ours", "flag"),
    [
        (schedule(30, 5, None), schedule(60, 5, None), "max_steps"),
        (schedule(30, 5, None), schedule(30, 10, None), "hv.local_steps"),
        (schedule(30, 5, None), schedule(30, 5, (640, 6)), "hv.pace"),
        (schedule(30, 5, (640, 6)), schedule(30, 5, (1280, 6)), "hv.target_tokens"),
        (schedule(30, 5, (640, 6)), schedule(30, 5, (640, 3)), "max_steps"),
        (schedule(30, 5, None, fragments=2), schedule(30, 5, None), "hv.fragments"),
        (schedule(30, 5, None, 2, 1), schedule(30, 5, None, 2), "hv.overlap_steps"),
    ],
)
def test_a_group_of_another_schedule_leaves_naming_the_flag_that_differs(theirs: str, ours: str, flag: str) -> None:
    """Groups with another last step, H, token budget (or tokens per step under one), fragments or overlap would
    not go to the same rounds or not end with one outer step: the later one leaves with one line naming the first
    field that differs; the same schedule is welcome, and a record without one (an earlier trainer) is not held
    against anyone."""
    hub = MemorySwarm(3)
    first = group(hub, 0, net(), schedule=theirs)
    first.claim_world_rank()
    first.join(0)
    assert hub.statuses[0].schedule == theirs
    group(hub, 1, net(seed=3), schedule=theirs).claim_world_rank()
    with pytest.raises(FieldError) as refused:
        group(hub, 2, net(seed=4), schedule=ours).claim_world_rank()
    error = refused.value.within("hv")
    assert error.fields[0] == flag
    rule = ("must pace their rounds alike: give every group the same --hv.pace (and --hv.target-tokens, if any)"
            if flag == "hv.pace" else "must share one schedule to go to the same rounds and end on one model: give "
            "every group the same --max-steps (or --epochs), --hv.local-steps or --hv.target-tokens, --hv.fragments "
            "and --hv.overlap-steps")  # fmt: skip
    assert str(error) == f"{flag}: worker group 0 (peer peer-0) runs {theirs}, this group {ours}; the groups of a run {rule}"
    mine = status(1, "aaa", state="joining", schedule=ours)
    assert rival_model(mine, [status(0, "aaa", schedule="")], lambda peer: True) is None


def test_records_of_trainers_before_fingerprints_still_read() -> None:
    old = {name: value for name, value in status(0, "aaa").to_dict().items() if name not in ("model", "parameters",
                                                                                             "peer")}  # fmt: skip
    read = Status.from_dict(old)
    assert read is not None and (read.model, read.parameters, read.peer) == ("", None, "")
    assert Status.from_dict(status(0, "aaa").to_dict() | {"model": 7}) is None  # a wrong type is not a record
    assert ModelId("abc", 3) == ModelId("abc", 3)


def test_the_claims_joining_record_is_not_republished_at_join() -> None:
    """Of two groups joining at once the older joining record stays: a group that claimed keeps its claim's record
    (and its time) through the join, or one claiming meanwhile would see it as the newer and stay too."""
    hub = MemorySwarm(1)
    first = group(hub, 0, net())
    published: list[Status] = []
    first.swarm.publish_status = lambda record: (published.append(record), hub.statuses.update({0: record}))
    first.claim_world_rank()
    first.join(0)
    assert [r.state for r in published] == ["joining", "training"]


def test_a_joining_group_takes_the_budget_of_the_first_live_group_within_bounds() -> None:
    """Under --hv.pace tokens a group takes the N and rounds of the group that set them first, if its peer answers
    and the budget is within 16x of its own; a record without a peer, or a dead one, sets nothing (anyone may write
    one), nor does a budget far off this group's (not one run's: it leaves or warns over it instead)."""
    ours = (1600, 3)
    mine = status(1, "aaa", state="joining", heard_at=200.0, schedule=schedule(60, 20, ours))
    live = lambda peer: peer != "peer-9"  # noqa: E731
    first = status(0, "aaa", schedule=schedule(60, 20, (400, 6)))
    assert budget_to_adopt(ours, True, mine, [first], live) == (400, 6)
    assert budget_to_adopt(ours, False, mine, [first], live) is None  # its N was given, and differs
    assert budget_to_adopt((400, 3), False, mine, [first], live) == (400, 6)  # the same N: the swarm's length
    later = status(2, "aaa", state="joining", heard_at=300.0, schedule=schedule(60, 20, (800, 6)))
    assert budget_to_adopt(ours, True, mine, [later], live) is None  # this group came first
    assert budget_to_adopt(ours, True, mine, [status(0, "aaa", peer="", schedule=first.schedule)], live) is None
    assert budget_to_adopt(ours, True, mine, [status(9, "aaa", schedule=first.schedule)], live) is None  # dead
    far = status(0, "aaa", schedule=schedule(60, 20, (1600, 1000)))
    assert budget_to_adopt(ours, True, mine, [far], live) is None  # 1000 rounds against 3: not one run's
    assert budget_to_adopt(ours, True, mine, [status(0, "bbb", schedule=first.schedule)], live) is None  # a model


def test_a_group_away_on_a_checkpoint_says_until_when_and_clears_it_once_back() -> None:
    """``DiLoCo.pause``: rank 0's status record names the end of the pause at once (the other groups' rounds expect
    it after it, ``arrivals.arrival``); back earlier, it says so at once."""
    hub = MemorySwarm(1)
    first = group(hub, 0, net())
    first.claim_world_rank()
    first.join(0)
    assert hub.statuses[0].paused_until is None
    before = time.time()
    first.pause(8.0)  # 8 s expected: announced with the margin (an evaluation can take 1.3x the one before)
    assert before + PAUSE_MARGIN * 8.0 <= hub.statuses[0].paused_until <= time.time() + PAUSE_MARGIN * 8.0
    first.pause(None)  # back before the pause it announced ended: said at once
    assert hub.statuses[0].paused_until is None

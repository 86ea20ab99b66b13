"""The swarm-wide token budget (`--hv.target-tokens`): the round-token records, the estimate, and groups of
different speeds taking outer steps together through the in-memory swarm."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diloco.config import HvConfig
from diloco.errors import FieldError
from diloco.outer.agreement import schedule
from diloco.outer.diloco import DiLoCo
from diloco.outer.links import solo_group
from diloco.outer.memory import MemorySwarm
from diloco.outer.pace import HOLD_SHARE, FixedSteps, TokenBudget
from diloco.swarm.records import budget
from diloco.swarm.records.budget import HORIZON_S, RoundTokens
from diloco.swarm.records.fingerprint import ModelId
from diloco.swarm.records.progress import Progress
from tests.support.outer import Layered, flat, runs_of
from tests.support.parse import usage_error
from tests.support.procs import FAST
from tests.support.records import owned, progress_record

# ---------------------------------------------------------------- the records and the estimate


def test_other_groups_are_extrapolated_by_their_rate_and_a_closed_one_is_not() -> None:
    mine = RoundTokens(world_rank=0, outer_step=3, tokens=100, tokens_per_s=50.0, at=1000.0)
    others = [
        RoundTokens(1, 3, 40, 10.0, at=998.0),  # 2 s old: 40 + 2 × 10
        RoundTokens(2, 3, 70, 99.0, at=990.0, closed=True),  # waits in the round: as it is
        RoundTokens(3, 2, 500, 10.0, at=999.0),  # still in an older round: not this one's tokens
        RoundTokens(0, 3, 1, 1.0, at=0.0),  # this group's own, older record: its exact count wins
    ]
    assert budget.swarm_tokens(others, mine, now=1000.0, galaxy_size=4) == pytest.approx(100 + 60 + 70)
    assert not budget.ahead(others, mine)
    assert budget.ahead([RoundTokens(1, 4, 0, 0.0, at=999.0)], mine)


def test_a_strangers_token_records_count_at_most_the_cap_in_the_galaxys_world_ranks() -> None:
    """A stranger's record of 10**15 tokens counts as OTHERS_CAP times this group's own; records of world ranks
    outside the galaxy count nothing, however many; two records of one world rank count once. So even with every
    other world rank forged, a round of N tokens is not due before this group trained `earliest` of them."""
    mine = RoundTokens(world_rank=0, outer_step=3, tokens=100, tokens_per_s=50.0, at=1000.0)
    huge = [RoundTokens(1, 3, 10**15, 10.0**9, at=1000.0), RoundTokens(1, 3, 10**15, 0.0, at=1000.0, closed=True)]
    outside = [RoundTokens(w, 3, 10**15, 0.0, at=1000.0) for w in range(4, 1000)]
    cap = budget.OTHERS_CAP * 100
    assert budget.swarm_tokens(huge + outside, mine, now=1000.0, galaxy_size=4) == pytest.approx(100 + cap)
    every = [RoundTokens(w, 3, 10**15, 0.0, at=1000.0) for w in (1, 2, 3)]
    assert budget.swarm_tokens(every, mine, now=1000.0, galaxy_size=4) == pytest.approx(100 * (1 + 3 * 8.0))
    target = 100 * (1 + 3 * budget.OTHERS_CAP)  # due at exactly 100 own tokens, and not one token before
    assert budget.earliest(target, 4) == pytest.approx(100)
    less = RoundTokens(0, 3, 99, 50.0, at=1000.0)
    assert budget.swarm_tokens(every, less, now=1000.0, galaxy_size=4) < target
    assert budget.swarm_tokens(every, mine, now=1000.0, galaxy_size=1) == 100  # a galaxy of one: only its own
    # before a step of its own this group counts nobody's tokens (it cannot tell a stranger from a fast group)
    assert budget.swarm_tokens(every, RoundTokens(0, 3, 0, 0.0, at=1000.0), now=1000.0, galaxy_size=4) == 0


def test_honest_groups_of_unequal_speed_count_in_full() -> None:
    """The hetero bench's groups (0.8, 0.4 and 0.2 of a core) train 37, 18 and 8 inner steps of a round: in every
    group's estimate the others count in full, so all reach the budget at one moment."""
    tps = 1024
    steps = {0: 37, 1: 18, 2: 8}
    records = [RoundTokens(w, 5, n * tps, 0.0, at=1000.0, closed=True) for w, n in steps.items()]
    for w, n in steps.items():
        mine = RoundTokens(w, 5, n * tps, 0.0, at=1000.0)
        assert budget.swarm_tokens(records, mine, now=1000.0, galaxy_size=3) == sum(steps.values()) * tps


def test_a_groups_share_of_the_swarms_rate_takes_each_latest_record_capped() -> None:
    """``budget.own_share``, where the LR schedule stands within a round: this group's rate over the galaxy's, each
    other world rank by its latest record of any outer step, a stranger's rate capped at OTHERS_CAP times this
    group's, world ranks outside the galaxy ignored; groups taken as equal before any rate is known."""
    mine = RoundTokens(world_rank=0, outer_step=3, tokens=100, tokens_per_s=10.0, at=1000.0)
    assert budget.own_share([], mine, galaxy_size=4) == pytest.approx(1 / 4)  # nobody else heard of yet
    assert budget.own_share([RoundTokens(1, 3, 0, 30.0, 999.0)], replace(mine, tokens_per_s=0.0), 4) == 1 / 4
    records = [
        RoundTokens(1, 2, 500, 5.0, at=990.0),  # its last round's: older than the next one
        RoundTokens(1, 3, 0, 30.0, at=999.0),  # the latest: 30 tokens/s
        RoundTokens(2, 3, 10**15, 10.0**9, at=999.0),  # a stranger's: capped at 8 x 10
        RoundTokens(7, 3, 0, 10.0**9, at=999.0),  # outside the galaxy of 4
    ]
    assert budget.own_share(records, mine, galaxy_size=4) == pytest.approx(10 / (10 + 30 + 80))


def test_a_groups_next_step_end_follows_its_newest_record_of_the_round() -> None:
    """``budget.step_ends``: a record's `at` ends a step, the next end `step_s` later. A step that ended unheard of
    before the swarm's tokens reached the target (999.0 here) did not take its group to the round, one after it
    may have: none. Groups in the round (closed), without a step time, writing from a clock ahead of this one, of
    another round or outside the galaxy have none either."""
    mine = RoundTokens(world_rank=0, outer_step=3, tokens=100, tokens_per_s=50.0, at=1000.0, step_s=0.25)
    records = [
        RoundTokens(1, 3, 40, 10.0, at=999.9, step_s=0.4),  # its step under way ends at 1000.3
        RoundTokens(1, 3, 30, 10.0, at=998.0, step_s=9.0),  # an older record of world rank 1: the newest counts
        RoundTokens(2, 3, 40, 10.0, at=999.9, step_s=1.0),  # ends at 1000.9
        RoundTokens(3, 3, 40, 10.0, at=999.9, step_s=1.0, closed=True),  # in the round already
        RoundTokens(4, 3, 40, 10.0, at=999.9),  # no step time (not known yet)
        RoundTokens(5, 3, 40, 10.0, at=998.5, step_s=1.0),  # ended a step at 999.5, after 999.0: maybe in the round
        RoundTokens(6, 3, 40, 10.0, at=1005.0, step_s=1.0),  # written after this clock's now
        RoundTokens(7, 2, 40, 10.0, at=999.9, step_s=1.0),  # training for another round
        RoundTokens(8, 3, 40, 10.0, at=997.5, step_s=1.4),  # ended one at 998.9, not due then: the next at 1000.3
        RoundTokens(9, 3, 40, 10.0, at=999.9, step_s=1.0),  # outside the galaxy of 9
    ]
    ends = budget.step_ends(records, mine, now=1000.0, galaxy_size=9, came_due=999.0)
    assert ends == pytest.approx({1: 1000.3, 2: 1000.9, 8: 1000.3})
    assert budget.closed(records, mine, galaxy_size=9) == {3}
    # a step time past the horizon counts as the horizon
    far = RoundTokens(1, 3, 40, 10.0, at=1000.0, step_s=10.0**9)
    assert budget.step_ends([far], mine, now=1000.0, galaxy_size=2, came_due=999.0) == {1: 1000.0 + HORIZON_S}


def held_pace(now: list[float], step_s: float) -> TokenBudget:
    """Group 0 of a galaxy of 3 (N = 600 tokens, 10 per inner step) that took two inner steps of `step_s` seconds,
    its round 10 s old, no other group's record read yet (each test writes its own)."""
    pace = TokenBudget(
        MemorySwarm(1).member("g0"), solo_group(), world_rank=0, target_tokens=600, galaxy_size=3,
        tokens_per_step=10, max_steps=300, clock=lambda: now[0],
    )  # fmt: skip
    pace.round_started = now[0] - 10.0
    for tokens in (0, 10):
        assert not pace.due(step=tokens // 10, outer_step=0, tokens=tokens)
        now[0] += step_s
    return pace


def test_a_due_group_trains_on_while_a_slower_group_ends_its_step_and_not_for_one_of_its_own_speed() -> None:
    """The tokens make the round due; a slower group ends the step it is in 0.9 s later: a group of 0.25 s steps
    takes inner steps until its own end within half a step of that (held_s in the round's row), then comes to the
    round. A group as fast is not held for. A group that came to the round meanwhile
    (closed) is not waited for any longer."""
    now = [1000.0]
    pace = held_pace(now, 0.25)
    hub = pace.swarm.swarm
    hub.tokens[1] = RoundTokens(1, 0, 300, 30.0, at=now[0] - 0.1, step_s=0.25)  # as fast: ends within a step
    hub.tokens[2] = RoundTokens(2, 0, 300, 30.0, at=now[0] - 0.1, step_s=1.0)  # ends at now + 0.9
    taken = []
    while not pace.due(step=2 + len(taken), outer_step=0, tokens=300 + 10 * len(taken)):
        taken.append(now[0])
        now[0] += 0.25
    # due at +0 but held, and so on while more than half a step of its own remains to the slow group's end at +0.9
    assert len(taken) == 4, taken
    assert pace.summary(340)["held_s"] == pytest.approx(1.0)
    assert hub.tokens[0].closed and hub.tokens[0].step_s == pytest.approx(0.25)
    pace.new_round(outer_step=1)
    del hub.tokens[2]
    now[0] += 0.25
    hub.tokens[1] = RoundTokens(1, 1, 300, 30.0, at=now[0] - 0.1, step_s=0.25)
    assert pace.due(step=10, outer_step=1, tokens=300)  # only a group of its own speed: no hold
    assert pace.summary(300)["held_s"] == 0.0

    pace = held_pace(now, 0.25)
    hub = pace.swarm.swarm
    hub.tokens[2] = RoundTokens(2, 0, 300, 30.0, at=now[0] - 0.1, step_s=1.0)
    assert not pace.due(step=2, outer_step=0, tokens=300)
    now[0] += 0.25
    hub.tokens[2] = replace(hub.tokens[2], closed=True, at=now[0] - 0.05)  # it came: the round forms now
    assert pace.due(step=3, outer_step=0, tokens=310)


def test_a_record_of_a_slow_group_holds_a_round_at_most_a_share_of_its_time() -> None:
    """A stranger's record of a group whose steps take 30 s (or a group that slow) holds this group's round for at
    most HOLD_SHARE of the round so far (11 s): then it goes to the round and waits there."""
    now = [1000.0]
    pace = held_pace(now, 0.5)
    pace.swarm.swarm.tokens[2] = RoundTokens(2, 0, 300, 30.0, at=now[0], step_s=30.0)
    start, steps = now[0], 0
    while not pace.due(step=2 + steps, outer_step=0, tokens=300 + 10 * steps):
        steps += 1
        now[0] += 0.5
    cap = HOLD_SHARE * (start - pace.round_started)  # of the 11 s the round had taken when it came due
    assert cap <= now[0] - start < cap + 0.5, (now[0] - start, cap)


def test_a_token_records_owner_is_its_subkeys_never_its_values() -> None:
    good = RoundTokens(1, 0, 5, 1.0, 2.0)
    assert "owner" not in good.to_dict()
    found = SimpleNamespace(value={owned(1, "k1"): SimpleNamespace(value=good.to_dict()),
                                   owned(2, "k2"): SimpleNamespace(value={**good.to_dict(), "owner": "k1"})})
    parsed = budget.parse(found)  # the second's value names an owner: refused
    assert [r.world_rank for r in parsed] == [1] and parsed[0].owner != ""


def test_a_silent_group_stops_adding_tokens_after_the_horizon() -> None:
    record = RoundTokens(1, 0, 10, 2.0, at=0.0)
    assert record.now(HORIZON_S * 10) == pytest.approx(10 + 2.0 * HORIZON_S)
    assert record.now(-5.0) == 10  # a clock behind the writer's: no negative extrapolation


@pytest.mark.parametrize(
    "data",
    [None, "x", {"world_rank": 0}, {**RoundTokens(0, 0, 1, 1.0, 1.0).to_dict(), "tokens": -1},
     {**RoundTokens(0, 0, 1, 1.0, 1.0).to_dict(), "tokens_per_s": math.inf},
     {**RoundTokens(0, 0, 1, 1.0, 1.0).to_dict(), "world_rank": "0"},
     {**RoundTokens(0, 0, 1, 1.0, 1.0).to_dict(), "step_s": -0.5},
     {**RoundTokens(0, 0, 1, 1.0, 1.0).to_dict(), "step_s": math.nan},
     {**RoundTokens(0, 0, 1, 1.0, 1.0).to_dict(), "step_s": "0.5"}],
)  # fmt: skip
def test_what_is_not_a_round_token_record_is_skipped(data: Any) -> None:
    good = SimpleNamespace(value=RoundTokens(1, 0, 5, 1.0, 2.0).to_dict())
    found = SimpleNamespace(value={owned(0): SimpleNamespace(value=data), owned(1): good, "1": good})
    assert budget.parse(found) == [RoundTokens(1, 0, 5, 1.0, 2.0)]  # (the record under "1" has no owner)


def test_target_tokens_and_local_steps_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="either --hv.local-steps .* or --hv.target-tokens"):
        HvConfig(galaxy_size=2, local_steps=10, target_tokens=1000)
    assert HvConfig(galaxy_size=2, target_tokens=1000).target_tokens == 1000
    both = ["--hv.galaxy-size", "2", "--hv.local-steps", "10", "--hv.target-tokens", "1000"]
    assert "--hv.target-tokens" in usage_error([*FAST, "--fake-data", *both], capsys)
    assert "--hv.target-tokens" in usage_error([*FAST, "--fake-data", "--hv.target-tokens", "0"], capsys)


def test_the_schedule_follows_the_swarm_and_ends_at_the_same_outer_step_everywhere() -> None:
    """Within a round the schedule stands at this group's tokens over its share of the swarm's rate (equal groups:
    its own steps), whatever the other groups' records of the round say yet; it ends at the same outer step
    everywhere."""
    hub, now = MemorySwarm(1), [1000.0]
    pace = TokenBudget(
        hub.member("g0"), solo_group(), world_rank=0, target_tokens=600, galaxy_size=3, tokens_per_step=20,
        max_steps=25, clock=lambda: now[0],
    )  # fmt: skip
    assert pace.steps_per_round == 10 and pace.final_outer_step == 3  # ⌈25 / 10⌉
    now[0] += 10.0  # 100 tokens in 10 s: 10 tokens/s
    hub.tokens[1] = RoundTokens(1, 0, 200, 10.0, at=now[0], closed=True)
    assert not pace.due(step=5, outer_step=0, tokens=100)  # 300 of 600
    assert pace.position(5, 0) == 3  # no record of world rank 2 yet: a share of 1/2, 100 of its 300 tokens
    hub.tokens[2] = RoundTokens(2, -1, 0, 10.0, at=now[0] - 30)  # its last round's record: its rate carries over
    assert not pace.due(step=5, outer_step=0, tokens=100)
    assert pace.position(5, 0) == 5  # a share of 1/3: 100 of its 200, half a round of 10 average steps
    hub.tokens[2] = RoundTokens(2, 0, 100, 30.0, at=now[0])
    assert not pace.due(step=5, outer_step=0, tokens=100)
    assert pace.position(5, 0) == 8  # a share of 1/5: 100 of its 120
    hub.tokens[1] = RoundTokens(1, 2, 0, 0.0, at=time.time())
    hub.records["g1", 1] = progress_record(1, "t1", "g1", outer_step=2)
    hub.providers["g1"] = lambda: ({}, [])
    assert pace.due(step=9, outer_step=1, tokens=100) is True  # group 1 is past outer step 1: catch up
    pace.new_round(outer_step=2)
    assert pace.position(0, 2) == 20 and pace.position(0, 3) == 25  # the end, wherever this group's steps are
    assert FixedSteps(10, 25).position(7, 0) == 7


def forged_budget(hub: MemorySwarm, clock: Callable[[], float]) -> TokenBudget:
    """Group 0's pace, a galaxy of 3, N = 3000 tokens per round, 10 per inner step, 300 inner steps (3 rounds)."""
    return TokenBudget(
        hub.member("g0"), solo_group(), world_rank=0, target_tokens=3000, galaxy_size=3, tokens_per_step=10,
        max_steps=300, clock=clock,
    )  # fmt: skip


def test_a_claim_of_being_ahead_counts_only_when_a_live_settled_unrefused_record_corroborates_it() -> None:
    """A stranger's token record of outer step 10**6 alone sends this group to no round; a settled progress record
    past this group's outer step corroborates it only while its peer answers, its state is not one this group
    refused, and this group trained the tokens below which no round can be due (`budget.earliest`)."""
    now = [1000.0]
    hub = MemorySwarm(1)
    pace = forged_budget(hub, lambda: now[0])
    hub.tokens[2] = RoundTokens(2, 10**6, 0, 0.0, at=now[0])
    earliest = budget.earliest(3000, 3)  # 3000 / 17
    assert not pace.due(step=100, outer_step=1, tokens=1000)  # nothing corroborates it
    fresh = replace(stranger_progress(outer_step=10**6), settled=False)
    hub.records["x", 2] = fresh
    now[0] += budget_corroborate_s()
    assert not pace.due(step=101, outer_step=1, tokens=1000)  # not settled
    hub.records["x", 2] = stranger_progress(outer_step=10**6)
    now[0] += budget_corroborate_s()
    assert not pace.due(step=102, outer_step=1, tokens=1000)  # its peer does not answer
    hub.providers["stranger"] = lambda: ({}, [])
    now[0] += 1.0
    assert not pace.due(step=103, outer_step=1, tokens=1000)  # the last verdict holds for CORROBORATE_S
    now[0] += budget_corroborate_s()
    assert not pace.due(step=104, outer_step=1, tokens=int(earliest) - 1)  # too few tokens of its own yet
    assert pace.due(step=105, outer_step=1, tokens=int(earliest) + 1)
    hub.tokens[2] = RoundTokens(2, 10**6, 0, 0.0, at=now[0], owner="someone else")
    now[0] += budget_corroborate_s()
    assert not pace.due(step=105, outer_step=1, tokens=1000)  # the progress record is another owner's
    hub.tokens[2] = RoundTokens(2, 10**6, 0, 0.0, at=now[0], owner="x")
    now[0] += budget_corroborate_s()
    assert pace.due(step=105, outer_step=1, tokens=1000)  # its own
    hub.records["x", 2] = stranger_progress(outer_step=10)
    now[0] += budget_corroborate_s()
    assert not pace.due(step=105, outer_step=1, tokens=1000)  # its progress is far behind its claim
    hub.tokens[2] = RoundTokens(2, 2, 0, 0.0, at=now[0])
    hub.records["x", 2] = stranger_progress(outer_step=1)
    now[0] += budget_corroborate_s()
    assert pace.due(step=105, outer_step=1, tokens=1000)  # a group that sent round 2 and has it on the wire
    pace.refused = lambda record: record.token == "t2"  # the catch-up refused its state too often
    now[0] += budget_corroborate_s()
    assert not pace.due(step=106, outer_step=1, tokens=1000)
    hub.records["x", 7] = progress_record(7, "t7", "stranger", outer_step=10**6)  # outside the galaxy
    now[0] += budget_corroborate_s()
    assert not pace.due(step=107, outer_step=1, tokens=1000)


def stranger_progress(outer_step: int) -> Progress:
    """A settled progress record of world rank 2, owner "x", served by peer "stranger"."""
    return replace(progress_record(2, "t2", "stranger", outer_step=outer_step), owner="x")


def budget_corroborate_s() -> float:
    from diloco.outer.pace import CORROBORATE_S

    return CORROBORATE_S


def test_forged_token_records_bring_rounds_no_earlier_than_the_bound_and_the_run_does_not_end_early() -> None:
    """Group 0 alone in a galaxy of 3, against a stranger's records of 10**15 tokens in every other world rank and
    of outer step 10**6: before, a round was due at every inner step and the run ended after 3 of them. Now a round
    is due once this group trained N / 17 tokens of it (`budget.earliest`): at most 17/3 times as often as among
    three equal groups (100 inner steps a round), and the run's 3 outer steps take at least 3 x 18 inner steps."""
    now = [1000.0]
    hub = MemorySwarm(1)
    pace = forged_budget(hub, lambda: now[0])
    for w in (1, 2):
        hub.tokens[w] = RoundTokens(w, 0, 10**15, 10.0**9, at=now[0], closed=True)
    hub.tokens[3] = RoundTokens(3, 10**6, 10**15, 0.0, at=now[0])
    outer_step, round_start, lengths = 0, 0, []
    for step in range(1, 1000):
        now[0] += 0.1
        for w in (1, 2):  # the stranger keeps its records at this group's outer step
            hub.tokens[w] = RoundTokens(w, outer_step, 10**15, 10.0**9, at=now[0])
        if pace.due(step, outer_step, (step - round_start) * 10):
            lengths.append(step - round_start)
            outer_step, round_start = outer_step + 1, step
            pace.new_round(outer_step)
            if pace.position(step, outer_step) >= 300:
                break
    assert pace.final_outer_step == 3  # 300 steps of an average group, 100 per round (3000 / (3 x 10))
    assert lengths == [math.ceil(budget.earliest(3000, 3) / 10)] * 3  # 18 inner steps each, not 1


# ---------------------------------------------------------------- groups of different speeds, in threads


def budget_groups(hub: MemorySwarm, nets: dict[int, torch.nn.Module], tokens_per_step: int, target_tokens: float,
                  fragments: dict[int, Any] | None = None, **kw: Any) -> dict[int, DiLoCo]:  # fmt: skip
    """Groups 0 and 1 of `hub` (outer 0.7/0.9) paced by a token budget of `target_tokens` per round, over 60 inner
    steps of an average group; `fragments` per group and `kw` go to each `DiLoCo`."""
    return {
        g: DiLoCo(
            [p.data for p in nets[g].parameters()], hub.member(f"g{g}"), solo_group(), world_rank=g, local_steps=1,
            outer_lr=0.7, outer_momentum=0.9, tokens_per_step=tokens_per_step,
            fragments=None if fragments is None else fragments[g],
            pace=TokenBudget(
                hub.member(f"g{g}"), solo_group(), world_rank=g, target_tokens=target_tokens, galaxy_size=2,
                tokens_per_step=tokens_per_step, max_steps=60,
            ),
            **kw,
        )  # fmt: skip
        for g in nets
    }


def drive(outers: dict[int, DiLoCo], delays: dict[int, float], inner_step: Callable[[int, int], None],
          ) -> tuple[list[int], dict[int, list[dict]]]:  # fmt: skip
    """Each group in a thread of its own: `inner_step(group, step)`, then its delay, until the schedule reaches 60
    steps of an average group. Returns each group's inner steps and its outer rows."""
    rows: dict[int, list[dict]] = {g: [] for g in outers}

    def run_group(g: int) -> int:
        outers[g].join(0)
        step = 0
        while outers[g].position(step) < 60:
            inner_step(g, step)
            time.sleep(delays[g])
            step += 1
            report = outers[g].after_inner_step(step)
            if report is not None:
                rows[g] += report.rows
        return step

    with ThreadPoolExecutor(len(outers)) as pool:
        return list(pool.map(run_group, sorted(outers))), rows


def test_groups_of_different_speeds_step_together_and_weights_follow_tokens() -> None:
    """Group 0 takes an inner step every 2 ms, group 1 every 20 ms: under a token budget the fast one trains more
    inner steps per round, every round's weights are the groups' tokens, and they end bit-identical at the same
    outer step with the same schedule position."""
    torch.manual_seed(0)
    hub, tokens_per_step, delays = MemorySwarm(2), 10, {0: 0.002, 1: 0.020}
    nets = {g: torch.nn.Linear(4, 4) for g in (0, 1)}
    for net in nets.values():
        net.load_state_dict(nets[0].state_dict())
    outers = budget_groups(hub, nets, tokens_per_step, 400)

    @torch.no_grad()
    def inner_step(g: int, step: int) -> None:
        for p in nets[g].parameters():
            p.add_(torch.randn_like(p), alpha=1e-3)

    steps, rows = drive(outers, delays, inner_step)
    assert [[r["outer_step"] for r in rows[g]] for g in (0, 1)] == [[1, 2, 3]] * 2, rows
    assert steps[0] > 2 * steps[1], steps
    for fast, slow in zip(rows[0], rows[1], strict=True):
        assert fast["num_peers"] == slow["num_peers"] == 2
        assert fast["tokens"] > slow["tokens"] > 0
        assert fast["weight"] == fast["tokens"] and slow["weight"] == slow["tokens"]
        assert fast["outer_digest"] == slow["outer_digest"]
        assert 0.5 * 400 <= fast["tokens"] + slow["tokens"] <= 2 * 400  # about the budget, from estimates
    assert all(torch.equal(p, q) for p, q in zip(nets[0].parameters(), nets[1].parameters()))
    assert outers[0].position(steps[0]) == outers[1].position(steps[1]) == 60


@pytest.mark.parametrize("overlap", [0, 2])
def test_fragments_under_a_token_budget_keep_one_outer_state_and_weigh_each_fragments_own_tokens(
    overlap: int,
) -> None:
    """Two fragments, N = 400 swarm tokens per pass over the model: a fragment's round every 200 tokens, blocking
    or landed 2 inner steps later. The groups (2 ms and 20 ms per step) average fragments 0, 1, 0, ... in the same
    rounds with one outer digest per outer step; each round's weights are the tokens since that fragment was last
    reset (about two rounds' worth once both fragments had a round); the last round takes every fragment, and they
    end bit-identical at the end of the schedule."""

    hub, tokens_per_step, delays = MemorySwarm(2), 10, {0: 0.002, 1: 0.020}
    nets = {g: Layered() for g in (0, 1)}
    outers = budget_groups(hub, nets, tokens_per_step, 400 / 2, overlap_steps=overlap,
                           fragments={g: runs_of(nets[g], 2) for g in (0, 1)})  # fmt: skip
    opts = {g: torch.optim.SGD(nets[g].parameters(), lr=0.05) for g in nets}

    def inner_step(g: int, step: int) -> None:
        gen = torch.Generator().manual_seed(1000 * step + g)
        opts[g].zero_grad()
        x, y = torch.randn(4, 3, generator=gen), torch.randn(4, 1, generator=gen)
        torch.nn.functional.mse_loss(nets[g](x), y).backward()
        opts[g].step()

    steps, rows = drive(outers, delays, inner_step)
    final = outers[0].pace.final_outer_step  # type: ignore[attr-defined]
    assert final == 6  # 60 steps of an average group, 10 per fragment round (200 / (2 x 10))
    # the last round averages fragment 1 (outer step 6), then fragment 0 again (7): a row each
    assert [[r["outer_step"] for r in rows[g]] for g in (0, 1)] == [[1, 2, 3, 4, 5, 6, 7]] * 2, rows
    assert [r["fragment"] for r in rows[0]] == [0, 1, 0, 1, 0, 1, 0]
    for fast, slow in zip(rows[0], rows[1], strict=True):
        assert fast["outer_digest"] == slow["outer_digest"] and fast["num_peers"] == slow["num_peers"] == 2
        assert fast["weight"] == fast["tokens"] > slow["tokens"] > 0
    if overlap:  # every round but the last step's two landed later, with the steps taken meanwhile
        assert all(r["step"] > r["round_step"] for g in (0, 1) for r in rows[g][:-2])
        assert not any("round_step" in r for g in (0, 1) for r in rows[g][-2:])
        # the fast group (about 17 steps a round) lands each one when its T steps are up, not at its next step: the
        # budget of the next round counts from the send, not from the landing
        assert [r["step"] - r["round_step"] for r in rows[0][:-2]] == [overlap] * 5
        # a landed round's row tells the swarm's tokens at its send (the budget, 200), not the next round's
        assert max(r["swarm_tokens"] for r in rows[0][:-2]) >= 200, rows[0]
    passes = [rows[0][i]["tokens"] + rows[1][i]["tokens"] for i in range(2, 5)]
    assert all(0.75 * 400 <= t <= 2 * 400 for t in passes), passes  # two rounds of tokens, not one (200)
    assert steps[0] > 2 * steps[1], steps
    assert torch.equal(flat(nets[0]), flat(nets[1])) and torch.equal(flat(nets[0]), outers[0].outer)
    assert outers[0].position(steps[0]) == outers[1].position(steps[1]) == 60


def test_groups_of_another_batch_take_the_first_groups_budget_and_end_together() -> None:
    """--hv.pace tokens: N follows H of the group that sets it. Group 1 trains 4 times as many tokens per inner step
    (another batch), so its own N would be 4 times group 0's; joining after group 0 it takes group 0's N and run
    length in rounds (announced in its status record's schedule), says so in its own, and the two end bit-identical
    at the same outer step, each round weighted by the groups' tokens. A group whose N was given and differs
    leaves, naming --hv.target-tokens."""
    torch.manual_seed(0)
    hub, delays = MemorySwarm(2), {0: 0.002, 1: 0.008}
    per_step = {0: 10, 1: 40}
    nets = {g: torch.nn.Linear(4, 4) for g in (0, 1)}
    nets[1].load_state_dict(nets[0].state_dict())

    def build(g: int, follows_h: bool = True, target: int | None = None) -> DiLoCo:
        pace = TokenBudget(hub.member(f"g{g}"), solo_group(), world_rank=g, galaxy_size=2, max_steps=60,
                           target_tokens=target or 20 * 2 * per_step[g], tokens_per_step=per_step[g],
                           follows_h=follows_h)  # fmt: skip
        return DiLoCo([p.data for p in nets[g].parameters()], hub.member(f"g{g}"), solo_group(), world_rank=g,
                      local_steps=1, outer_lr=0.7, outer_momentum=0.9, tokens_per_step=per_step[g], pace=pace,
                      schedule=schedule(60, 20, pace.budget()), claim_settle_s=0.0,
                      model=ModelId("fp", 20))  # fmt: skip

    outers = {0: build(0)}
    outers[0].claim_world_rank()
    hub.providers["g0"] = outers[0]._current_state  # live (it serves its state once it joined)
    assert hub.statuses[0].schedule == "3 rounds of 400 tokens"
    with pytest.raises(FieldError, match="target_tokens"):
        build(1, follows_h=False, target=1600).claim_world_rank()  # N given, and another
    outers[1] = build(1)
    assert outers[1].budget() == (1600, 3)
    outers[1].claim_world_rank()
    assert outers[1].budget() == (400, 3) and hub.statuses[1].schedule == "3 rounds of 400 tokens"

    @torch.no_grad()
    def inner_step(g: int, step: int) -> None:
        for p in nets[g].parameters():
            p.add_(torch.randn_like(p), alpha=1e-3)

    steps, rows = drive(outers, delays, inner_step)
    assert [[r["outer_step"] for r in rows[g]] for g in (0, 1)] == [[1, 2, 3]] * 2, rows
    for a, b in zip(rows[0], rows[1], strict=True):
        assert a["num_peers"] == b["num_peers"] == 2 and a["outer_digest"] == b["outer_digest"]
        assert a["weight"] == a["tokens"] and b["weight"] == b["tokens"]
    assert all(torch.equal(p, q) for p, q in zip(nets[0].parameters(), nets[1].parameters()))
    assert outers[0].position(steps[0]) == outers[1].position(steps[1]) == 60

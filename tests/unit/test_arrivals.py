"""How long a group at a boundary waits for the others (``diloco.swarm.records.arrivals``), from status records."""

from __future__ import annotations

import pytest

from diloco.swarm.records.arrivals import (
    FLOOR_S,
    LAST_SLACK,
    LAST_SLACK_S,
    SKEW_S,
    SLACK_S,
    STALE_S,
    arrival,
    plan_wait,
    stale_after,
    tokens_per_step,
)
from tests.support.records import NOW, record

BATCH = "4x128"  # 512 tokens per inner step


def coming(world_rank: int, step: int, steps_per_s: float, heard_ago: float = 1.0, **changes: object):
    """The status record of a group at inner step `step`, `steps_per_s` fast, heard `heard_ago` s before NOW."""
    fields = {"peer": f"g{world_rank}", "step": step, "batch": BATCH, "tokens_per_s": steps_per_s * 512,
              "heard_at": NOW - heard_ago}  # fmt: skip
    return record(world_rank, **fields | changes)


def wait(records: list, boundary: int | None = 100, bound: float = 60.0, cap: float = 600.0) -> float:
    return plan_wait(records, me="g0", boundary=boundary, now=NOW, bound=bound, cap=cap)


@pytest.mark.parametrize(("batch", "tokens"), [("4x128", 512), ("16x1024", 16384), ("", None), ("4x", None),
                                               ("0x128", None), ("x128", None), ("4x128x2", None), ("-4x128", None)])
def test_tokens_per_step_from_a_records_batch(batch: str, tokens: int | None) -> None:
    assert tokens_per_step(batch) == tokens


def test_arrival_extrapolates_from_the_last_heartbeat() -> None:
    # at step 80, 2 steps/s, heard 4 s ago: it reaches step 100 in 10 - 4 = 6 s
    assert arrival(coming(1, 80, 2.0, heard_ago=4), 100, NOW) == pytest.approx(6.0)
    assert arrival(coming(1, 100, 2.0), 100, NOW) == 0.0  # there already (in matchmaking)
    assert arrival(coming(1, 99, 2.0, heard_ago=30), 100, NOW) == 0.0  # overdue: expected now
    assert arrival(coming(1, 80, 2.0, tokens_per_s=None), 100, NOW) is None  # no metrics row yet
    assert arrival(coming(1, 80, 2.0, batch=""), 100, NOW) is None  # an earlier trainer's record


def test_a_round_waits_for_a_group_due_within_one_of_its_own_rounds() -> None:
    # group 1 reaches step 100 in 30 s; this group's own round took 60 s: wait for it, with some slack
    assert wait([coming(1, 50, 1.0, heard_ago=10)]) == pytest.approx(40 + max(SLACK_S, 4.0))
    # two groups coming: the wait covers the later one
    assert wait([coming(1, 90, 1.0), coming(2, 60, 1.0, heard_ago=0)]) == pytest.approx(44.0)


def test_a_round_does_not_wait_for_a_group_beyond_the_bound_nor_a_stale_or_gone_one() -> None:
    assert wait([coming(1, 0, 1.0)]) == FLOOR_S  # 99 s away, more than one own round (60 s)
    assert wait([coming(1, 80, 1.0, heard_ago=STALE_S + 3)]) == FLOOR_S  # no heartbeat lately: dead or blocked
    # a group of 10 s inner steps sends a heartbeat every 10 s: its record is stale later
    slow = coming(1, 96, 0.1, heard_ago=STALE_S + 3)
    assert stale_after(slow) == STALE_S + 20 and wait([slow]) == pytest.approx(22 + 2.2)
    assert wait([coming(1, 60, 1.0, state="finished")]) == FLOOR_S
    assert wait([coming(0, 60, 1.0)]) == FLOOR_S  # its own record
    assert wait([]) == FLOOR_S


def test_the_wait_stays_between_the_floor_and_the_cap() -> None:
    assert wait([coming(1, 99, 1.0, heard_ago=0.5)]) == FLOOR_S  # arriving in half a second
    assert wait([coming(1, 50, 1.0, heard_ago=10)], cap=10.0) == 10.0  # --hv.matchmaking-time 10: a cap
    assert wait([], cap=3.0) == 3.0  # a cap below the floor wins


def test_unknown_pace_waits_up_to_the_bound_and_a_token_budget_expects_everyone_now() -> None:
    assert wait([coming(1, 80, 1.0, tokens_per_s=None)], bound=20.0) == pytest.approx(20 + SLACK_S)
    unknown_pace = plan_wait([coming(1, 80, 1.0, tokens_per_s=None)], me="g0", boundary=100, now=NOW, bound=3600,
                             cap=3600, unknown=10)  # fmt: skip
    assert unknown_pace == pytest.approx(10 + SLACK_S)  # the last round's long bound is for groups of known pace
    # under a token budget every group's round is due at one moment: a live group is expected now
    assert wait([coming(1, 0, 1.0)], boundary=None) == FLOOR_S


def test_records_a_stranger_may_write_are_not_waited_for() -> None:
    """A record dated ahead of this clock (it would never go stale) or of a world rank outside the galaxy."""
    ahead = coming(1, 90, 1.0, heard_ago=-(SKEW_S + 5))
    assert wait([ahead]) == FLOOR_S
    outside = coming(7, 90, 1.0)
    assert plan_wait([outside], me="g0", boundary=100, now=NOW, bound=60, cap=600, galaxy_size=4) == FLOOR_S
    assert plan_wait([outside], me="g0", boundary=100, now=NOW, bound=60, cap=600) > FLOOR_S  # (no galaxy given)


def test_a_groups_record_carries_the_median_of_its_last_rows_throughput() -> None:
    """The row after a round (or an evaluation) counts its time too: one slow row must not make the others expect
    the group far later than it comes."""
    from diloco.outer.beacon import RATE_ROWS, Beacon

    beacon = Beacon(None, True, 0, 1, "FULL_SHARD", "tcp", "", "", None, None, "g0")  # type: ignore[arg-type]
    for rate in (1000.0, 1010.0, 990.0, 20.0):  # the last row held a round
        beacon.measured(rate)
    assert beacon.tokens_per_s == 995.0
    for _ in range(RATE_ROWS):
        beacon.measured(20.0)  # slower for good: it follows within a few rows
    assert beacon.tokens_per_s == 20.0


def test_the_last_round_waits_far_past_the_latest_arrival() -> None:
    """Groups that finished lose nothing by waiting and a group that misses the last round has no later one: one
    slow step of a group on its way (a busy machine) must not cost its inner steps."""
    coming_in_10s = [coming(1, 90, 1.0)]  # 10 steps before the boundary at 1 step/s, heard just now
    arrival = wait(coming_in_10s) - max(SLACK_S, 0.1 * 10)
    last = plan_wait(coming_in_10s, me="g0", boundary=100, now=NOW, bound=3600, cap=3600, last=True)
    assert last == pytest.approx(arrival + max(LAST_SLACK_S, LAST_SLACK * arrival))
    assert last >= 2 * arrival and last >= arrival + 30
    assert plan_wait([], me="g0", boundary=100, now=NOW, bound=3600, cap=3600, last=True) == FLOOR_S  # nobody coming


def test_a_group_away_on_a_checkpoint_is_expected_after_it() -> None:
    """A group that announced a pause (``paused_until``: a checkpoint or an evaluation as long as its last one)
    resumes its inner steps when the pause ends: its arrival moves by the pause, and the wait with it; a pause that
    ended changes nothing, and one beyond the bound (or a stranger's far-future one) is not waited for."""
    assert arrival(coming(1, 90, 1.0, heard_ago=2, paused_until=NOW + 8), 100, NOW) == pytest.approx(18.0)
    assert arrival(coming(1, 90, 1.0, heard_ago=2, paused_until=NOW - 30), 100, NOW) == pytest.approx(8.0)
    assert wait([coming(1, 90, 1.0, heard_ago=2, paused_until=NOW + 8)]) == pytest.approx(18 + SLACK_S)
    assert wait([coming(1, 90, 1.0, paused_until=NOW + 1e9)]) == FLOOR_S


def test_a_beacon_announces_a_pause_and_clears_it() -> None:
    from diloco.outer.beacon import Beacon

    beacon = Beacon(None, True, 0, 1, "FULL_SHARD", "tcp", "", "", None, None, "g0")  # type: ignore[arg-type]
    assert beacon.record("training", 5, 0, "").paused_until is None
    beacon.paused_until = NOW + 8
    sent = beacon.record("training", 5, 0, "")
    assert sent.paused_until == NOW + 8
    assert type(sent).from_dict(sent.to_dict()) == sent
    assert type(sent).from_dict(sent.to_dict() | {"paused_until": "soon"}) is None


def test_a_pause_is_expected_as_long_as_the_longest_of_its_kind() -> None:
    """``trainer.away``: the pause it hands the outer loop is the longest of its kind so far (an evaluation that took
    5.6 s took 7.1 s the next time on a shared machine: the last one's length made the others average without the
    group; ``DiLoCo.pause`` adds its margin), none before the first, and the end of the block says it is back."""
    from types import SimpleNamespace

    from diloco.train.trainer import away

    announced: list[float | None] = []
    run = SimpleNamespace(outer=SimpleNamespace(pause=announced.append))
    for took in ([], [5.6, 7.1, 5.9]):
        with away(run, took):  # type: ignore[arg-type]
            pass
    assert announced == [None, None, 7.1, None]

"""The swarm-wide token budget (`--hv.target-tokens`): the round-token records, the estimate, and groups of
different speeds taking outer steps together through the in-memory swarm."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diloco.config import HvConfig
from diloco.outer.diloco import DiLoCo
from diloco.outer.links import solo_group
from diloco.outer.memory import MemorySwarm
from diloco.outer.pace import FixedSteps, TokenBudget
from diloco.swarm.records import budget
from diloco.swarm.records.budget import HORIZON_S, RoundTokens
from tests.support.outer import Layered, flat, runs_of
from tests.support.parse import usage_error
from tests.support.procs import FAST
from tests.support.records import owned

# ---------------------------------------------------------------- the records and the estimate


def test_other_groups_are_extrapolated_by_their_rate_and_a_closed_one_is_not() -> None:
    mine = RoundTokens(world_rank=0, outer_step=3, tokens=100, tokens_per_s=50.0, at=1000.0)
    others = [
        RoundTokens(1, 3, 40, 10.0, at=998.0),  # 2 s old: 40 + 2 × 10
        RoundTokens(2, 3, 70, 99.0, at=990.0, closed=True),  # waits in the round: as it is
        RoundTokens(3, 2, 500, 10.0, at=999.0),  # still in an older round: not this one's tokens
        RoundTokens(0, 3, 1, 1.0, at=0.0),  # this group's own, older record: its exact count wins
    ]
    assert budget.swarm_tokens(others, mine, now=1000.0) == pytest.approx(100 + 60 + 70)
    assert not budget.ahead(others, mine)
    assert budget.ahead([RoundTokens(1, 4, 0, 0.0, at=999.0)], mine)


def test_a_silent_group_stops_adding_tokens_after_the_horizon() -> None:
    record = RoundTokens(1, 0, 10, 2.0, at=0.0)
    assert record.now(HORIZON_S * 10) == pytest.approx(10 + 2.0 * HORIZON_S)
    assert record.now(-5.0) == 10  # a clock behind the writer's: no negative extrapolation


@pytest.mark.parametrize(
    "data",
    [None, "x", {"world_rank": 0}, {**RoundTokens(0, 0, 1, 1.0, 1.0).to_dict(), "tokens": -1},
     {**RoundTokens(0, 0, 1, 1.0, 1.0).to_dict(), "tokens_per_s": math.inf},
     {**RoundTokens(0, 0, 1, 1.0, 1.0).to_dict(), "world_rank": "0"}],
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
    hub = MemorySwarm(1)
    pace = TokenBudget(
        hub.member("g0"), solo_group(), world_rank=0, target_tokens=600, galaxy_size=3, tokens_per_step=20,
        max_steps=25,
    )  # fmt: skip
    assert pace.steps_per_round == 10 and pace.final_outer_step == 3  # ⌈25 / 10⌉
    hub.tokens[1] = RoundTokens(1, 0, 200, 0.0, at=time.time(), closed=True)
    assert not pace.due(step=5, outer_step=0, tokens=100)  # 300 of 600
    assert pace.position(5, 0) == 5  # half a round of 10 average steps
    hub.tokens[1] = RoundTokens(1, 2, 0, 0.0, at=time.time())
    assert pace.due(step=9, outer_step=1, tokens=0) is True  # another group is past outer step 1: catch up
    pace.new_round(outer_step=2)
    assert pace.position(0, 2) == 20 and pace.position(0, 3) == 25  # the end, wherever this group's steps are
    assert FixedSteps(10, 25).position(7, 0) == 7


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

"""`diloco bench hetero`'s dead-group arm: what a group that dies mid-run costs the groups that live on.

The equal trio under the default pace, every flag else at its default; once group 2 has taken its outer step
`DEAD_AFTER` its trainer is killed (`kill -9`, as when its machine dies; its DHT, averager and p2pd follow their
parent). The survivors' rounds are sorted by when they began (an outer row's time less its `averaging_s`) against
the kill: before it; while the dead group's status record still looks live (its last heartbeat, at most one inner
step before the kill, plus ``arrivals.stale_after``: ``STALE_S`` and two of its steps); after. Per phase: the
rounds, their matchmaking waits (`wait_s`) and how many groups each had. The claim measured: a dead group costs the
others at most one bound per round (under the token pace every live group is due at once: the floor,
``arrivals.FLOOR_S``) until its heartbeat is stale, then nothing (the waits of before the kill, or less).
"""

from __future__ import annotations

import statistics
from typing import Any

from diloco.swarm.records.arrivals import FLOOR_S, STALE_S

DEAD_GROUP, DEAD_AFTER = 2, 2  # the group killed, after this many of its outer steps
PHASES = ("before the kill", "record still fresh", "record stale")


def stale_window(dead_rows: list[dict[str, Any]], tokens_per_step: int) -> float:
    """Seconds after the kill by which the dead group's record is stale: ``STALE_S`` plus two of its inner steps at
    the median rate of its last 5 (what its heartbeat carried)."""
    rates = [row["tokens_per_s"] for row in dead_rows if "tokens_per_s" in row][-5:]
    step_s = tokens_per_step / statistics.median(rates) if rates else 0.0
    return STALE_S + 2 * step_s


def phase_of(started: float, killed_at: float, stale_at: float) -> str:
    return PHASES[0] if started < killed_at else PHASES[1] if started < stale_at else PHASES[2]


def dead_figures(survivors: list[list[dict[str, Any]]], dead_rows: list[dict[str, Any]], killed_at: float,
                 tokens_per_step: int, after: int = DEAD_AFTER) -> dict[str, Any]:  # fmt: skip
    """The arm's figures from the survivors' metrics rows, the dead group's, the kill's unix time and the outer
    steps the dead group took (`after`)."""
    stale_s = stale_window(dead_rows, tokens_per_step)
    rounds = []
    for group, rows in enumerate(survivors):
        for row in rows:
            if "outer_step" not in row or "num_peers" not in row:
                continue  # a load without a round
            started = row["time"] - row.get("averaging_s", 0.0)
            rounds.append({"group": group, "outer_step": row["outer_step"], "since_kill_s": started - killed_at,
                           "wait_s": row.get("wait_s"), "averaging_s": row.get("averaging_s"),
                           "num_peers": row["num_peers"],
                           "phase": phase_of(started, killed_at, killed_at + stale_s)})  # fmt: skip
    phases = {}
    for phase in PHASES:
        waits = [r["wait_s"] for r in rounds if r["phase"] == phase and r["wait_s"] is not None]
        peers = [r["num_peers"] for r in rounds if r["phase"] == phase]
        phases[phase] = {"rounds": len(peers), "mean_wait_s": statistics.mean(waits) if waits else None,
                         "max_wait_s": max(waits) if waits else None, "num_peers": sorted(set(peers))}  # fmt: skip
    before, fresh, stale = (phases[phase]["max_wait_s"] for phase in PHASES)
    return {
        "dead_group": DEAD_GROUP,
        "killed_after_outer_steps": after,
        "dead_inner_steps": sum("tokens_per_s" in row for row in dead_rows),
        "stale_after_kill_s": stale_s,
        "bound_s": FLOOR_S,
        "rounds": sorted(rounds, key=lambda r: (r["since_kill_s"], r["group"])),
        "phases": phases,
        # the claim: no wait past the bound (and the round's own slack) while the record is fresh, and none longer
        # than before the kill once it is stale
        "fresh_within_bound": fresh is None or fresh <= FLOOR_S + 2.0,
        "stale_costs_nothing": stale is not None and before is not None and stale <= max(before, 1.0) + 0.5,
    }


def dead_lines(dead: dict[str, Any], flags: str) -> list[str]:
    """The arm's part of the bench's section: how it ran, one row per phase, the claim's verdict."""
    lines = [
        "",
        f"**A dead group** (equal trio, `{flags}`, every other flag at its default): group {dead['dead_group']} "
        f"killed (`kill -9` of its trainer) after its outer step {dead['killed_after_outer_steps']} "
        f"({dead['dead_inner_steps']} inner steps); its record is stale {dead['stale_after_kill_s']:.1f} s after the "
        "kill at the latest (15 s and two of its steps). The survivors' rounds by when they began:",
        "",
        "| phase | survivors' rounds | groups in them | mean wait (s) | longest wait (s) |",
        "|---|---:|---|---:|---:|",
    ]
    for phase, p in dead["phases"].items():
        mean = "–" if p["mean_wait_s"] is None else f"{p['mean_wait_s']:.1f}"
        longest = "–" if p["max_wait_s"] is None else f"{p['max_wait_s']:.1f}"
        lines.append(f"| {phase} | {p['rounds']} | {', '.join(map(str, p['num_peers'])) or '–'} | {mean} | "
                     f"{longest} |")  # fmt: skip
    fresh = "**met**" if dead["fresh_within_bound"] else "**missed**"
    stale = "**met**" if dead["stale_costs_nothing"] else "**missed**"
    lines += [
        "",
        f"- while its record looked live a round waited at most the bound ({dead['bound_s']:.0f} s under the token "
        f"pace, and 2 s of slack): {fresh}; once stale, no round waited longer than before the kill: {stale}",
    ]
    return lines

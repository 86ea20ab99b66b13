"""`diloco bench hetero`'s paused-group arm: whether the others' rounds wait for a group away on an evaluation.

The equal trio at a fixed H (`--hv.pace fixed`: each round is due at an inner step, so a group that spent seconds
away from its steps arrives that much later; under the token pace a round is due at one moment for every group and
a pause shorter than a round only moves tokens between groups), every flag else at its default; group
`PAUSED_GROUP` alone evaluates after each of its rounds (`--eval-interval` = H, `PAUSE_EVAL_STEPS` batches: seconds
longer than a round's floor wait, ``arrivals.FLOOR_S``). While it evaluates, its status record says until when it
expects to be away (``Status.paused_until``: now plus its last evaluation's seconds). Without that, its record would
put its arrival at the others' own (same pace, same step), and they would wait the floor and average without it.
Per evaluation during the run (not the one before its first step, nor the one at its end): the first round of the
other groups that began after the evaluation started, how many groups it had and how long they waited. The claim
measured: each such round had every group, its wait past the floor where the evaluation was longer than it.
"""

from __future__ import annotations

from typing import Any

from diloco.swarm.records.arrivals import FLOOR_S

PAUSED_GROUP, PAUSE_EVAL_STEPS = 2, 40


def evaluations(rows: list[dict[str, Any]], eval_s: list[float]) -> list[tuple[float, float]]:
    """(start, seconds) of a group's evaluations between its rounds: its eval rows (logged at their end) with the
    seconds its summary recorded for each, less the one before its first step and the one at its end."""
    ends = [(row["step"], row["time"]) for row in rows if "eval_loss" in row]
    timed = [(step, end - seconds, seconds) for (step, end), seconds in zip(ends, eval_s)]
    return [(start, seconds) for step, start, seconds in timed[:-1] if step > 0]


def pause_figures(others: list[list[dict[str, Any]]], paused_rows: list[dict[str, Any]], eval_s: list[float],
                  groups: int) -> dict[str, Any]:  # fmt: skip
    """The arm's figures from the other groups' metrics rows, the paused group's, and its evaluations' seconds."""
    rounds = sorted([(row["time"] - row.get("averaging_s", 0.0), group, row)
                     for group, rows in enumerate(others) for row in rows
                     if "outer_step" in row and "num_peers" in row], key=lambda r: r[:2])  # fmt: skip
    pauses = []
    for i, (start, seconds) in enumerate(evaluations(paused_rows, eval_s)):
        after = [(began, group, row) for began, group, row in rounds if began >= start]
        if not after:
            continue
        began = after[0][0]
        first = [row for b, group, row in after if b < began + 1.0]  # that round, as each other group logged it
        pauses.append({"evaluation": i + 1, "eval_s": seconds, "round_began_s": began - start,
                       "num_peers": min(row["num_peers"] for row in first),  # a split counts as a miss
                       "wait_s": max((row.get("wait_s") or 0.0) for row in first)})  # fmt: skip
    return {
        "paused_group": PAUSED_GROUP,
        "eval_steps": PAUSE_EVAL_STEPS,
        "floor_s": FLOOR_S,
        "pauses": pauses,
        # the claim: every round after an evaluation had every group, waiting past the floor where it had to
        "waited_for": bool(pauses) and all(p["num_peers"] == groups for p in pauses),
        "past_floor": sum(p["wait_s"] > FLOOR_S for p in pauses),
    }


def pause_lines(pause: dict[str, Any], flags: str) -> list[str]:
    """The arm's part of the bench's section: how it ran, one row per evaluation, the claim's verdict."""
    lines = [
        "",
        f"**A group away on an evaluation** (equal trio, `{flags}`, every other flag at its default): group "
        f"{pause['paused_group']} alone evaluates {pause['eval_steps']} batches after each of its rounds. Per "
        "evaluation during the run, the first round of the others that began after it:",
        "",
        "| evaluation | seconds | round began after (s) | groups in it | longest wait (s) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for p in pause["pauses"]:
        lines.append(f"| {p['evaluation']} | {p['eval_s']:.1f} | {p['round_began_s']:.1f} | {p['num_peers']} | "
                     f"{p['wait_s']:.1f} |")  # fmt: skip
    verdict = "**met**" if pause["waited_for"] else "**missed**"
    lines += ["", f"- every round after an evaluation had all the groups: {verdict} ({pause['past_floor']} of "
                  f"{len(pause['pauses'])} waited past the {pause['floor_s']:.0f} s floor, which is all a round "
                  "would wait for a group whose record says nothing of its pause)"]  # fmt: skip
    return lines

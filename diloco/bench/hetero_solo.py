"""`diloco bench hetero`'s reference: each group's tokens/s alone, measured before the swarm arms and, in a full run,
again after them.

Every ratio the bench reports divides a swarm's tokens/s by the sum of its groups' solo tokens/s, and the solo runs
take place minutes before or after the arms: on a shared host the same trainer under the same quota runs up to a
fifth faster or slower within one bench (docs/benchmarks.md, hetero of 2026-12-01: the solo runs side by side came
out 1.2× as fast as the same runs alone minutes earlier). One solo phase on each side of the arms brackets them: the
reference is the mean of both, and their ratio (`drift`, after ÷ before) says how far the host moved meanwhile, which
bounds how much any ratio can be trusted.

Plain Python over the figures ``diloco.bench.hetero.solo_figures`` returns.
"""

from __future__ import annotations

from typing import Any

AVERAGED = ("tokens_per_s", "cpu_per_step_s", "cores_in_steps", "main_share", "throttled_share_in_steps")


def bracket(before: list[dict[str, Any]], after: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Each group's solo figures from the runs `before` the arms and `after` them (None: not measured, the quick
    run): the mean of both for the `AVERAGED` figures, with each run's tokens/s and `drift` = after ÷ before."""
    if not after:
        return before
    merged = []
    for first, second in zip(before, after, strict=True):
        if first["cores"] != second["cores"]:
            raise ValueError(f"solo runs of {first['cores']} and {second['cores']} core bracket no group")
        figures = dict(first)
        for key in AVERAGED:
            values = [first.get(key), second.get(key)]
            figures[key] = None if None in values else sum(values) / 2
        figures |= {
            "tokens_per_s_before": first["tokens_per_s"],
            "tokens_per_s_after": second["tokens_per_s"],
            "drift": second["tokens_per_s"] / first["tokens_per_s"],
        }
        merged.append(figures)
    return merged


def ratios_either_side(solo: list[dict[str, Any]], tokens_per_s: float) -> dict[str, float] | None:
    """A swarm's `tokens_per_s` against the sum of its groups' solo runs before the arms and after them (None: solo
    measured once)."""
    if not all("drift" in s for s in solo):
        return None
    return {side: tokens_per_s / sum(s[f"tokens_per_s_{side}"] for s in solo) for side in ("before", "after")}


def drift_line(solo: list[dict[str, Any]]) -> str | None:
    """One sentence on the host's drift between the solo runs (None: measured once)."""
    if not all("drift" in s for s in solo):
        return None
    drifts = " / ".join(f"{s['drift']:.2f}" for s in solo)
    cores = " / ".join(f"{s['cores']:g}" for s in solo)
    return (f"Solo runs after the arms ÷ before them, tokens/s ({cores} core): {drifts}; the reference is their mean, "
            "and each arm's ratio against either run alone is given beside it")  # fmt: skip

"""The figures and the report of `diloco bench hetero` (`diloco.bench.hetero` runs the phases and reads the runs):
an arm's figures from its groups' rows and the sampler's CPU counters (`arm_figures`), the targets and the decision
rule (`targets`), the lines that say where an arm's throughput went (`explain`), its section of docs/benchmarks.md
and the plot. Every number comes from the runs' rows and the kernel's counters: none is typed in."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from diloco.bench import BenchError, machine_line
from diloco.bench.arms import row
from diloco.bench.hetero_dead import dead_lines
from diloco.bench.hetero_pause import pause_lines
from diloco.bench.hetero_solo import drift_line, ratios_either_side

__all__ = ["Counters", "arm_figures", "explain", "markdown", "plot", "step_cpu", "targets"]

TRIO_NAMES = ("unequal", "equal")  # the unequal trio, then every group at the middle share (`hetero.TRIOS`)
SOLO_ORDER = "one after the other, before the arms and again after them (each group: the mean of both)"
RATIO_TARGET = 0.95  # swarm tokens/s ÷ the sum of the groups' solo tokens/s
FULL_ROUNDS_TARGET = 0.95  # share of the swarm's rounds that had every group
DISCARD_TARGET = 0  # inner steps discarded while every group lives
EVAL_GAP_TARGET = 0.01  # tokens' final eval loss at most 1% above fixed's on equal groups (and below it on unequal)
MET = {True: "met", False: "missed", None: "not measured"}


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec)


def slashed(values: list[float | None], spec: str = ".2f") -> str:
    return " / ".join(fmt(v, spec) for v in values)


def arm_key(arm: dict[str, Any]) -> str:
    return f"{arm['trio']}-{arm['name']}"


# ---------------------------------------------------------------- an arm's figures


class Counters:
    """The sampler's series as arrays, for readings at any time (linear between samples)."""

    def __init__(self, series: dict[str, Any]) -> None:
        self.t = np.asarray(series["t"], dtype=float)
        self.series = series

    def at(self, name: str, times: Any, group: int | None = None) -> np.ndarray:
        values = self.series[name] if group is None else self.series[name][group]
        return np.interp(np.asarray(times, dtype=float), self.t, np.asarray(values, dtype=float))

    def between(self, name: str, spans: list[tuple[float, float]], group: int | None = None) -> float:
        """The counter's growth summed over (start, end) spans."""
        if not spans or len(self.t) < 2:
            return 0.0
        starts, ends = zip(*spans)
        return float(np.sum(self.at(name, ends, group) - self.at(name, starts, group)))


def step_cpu(counters: Counters | None, group: int, spans: list[tuple[float, float]]) -> dict[str, Any]:
    """The training process's CPU over its inner steps (`spans`): seconds per step, the cores it ran at inside them,
    its main thread's share, and the time and periods the kernel parked it."""
    wall = sum(end - start for start, end in spans)
    if counters is None or not spans or wall <= 0:
        return {"cpu_per_step_s": None, "cores_in_steps": None, "main_share": None, "throttled_s_in_steps": None,
                "throttled_share_in_steps": None}  # fmt: skip
    cpu, main = counters.between("train", spans, group), counters.between("main", spans, group)
    periods = counters.between("periods", spans, group)
    return {
        "cpu_per_step_s": cpu / len(spans),
        "cores_in_steps": cpu / wall,
        "main_share": main / cpu if cpu > 0 else None,
        "throttled_s_in_steps": counters.between("throttled_s", spans, group),
        "throttled_share_in_steps": counters.between("throttled", spans, group) / periods if periods > 0 else None,
    }


def swarm_rounds(groups: list[dict[str, Any]]) -> tuple[int, int]:
    """(rounds that had every group, rounds) of the swarm: a round per outer step reached by averaging (a
    `num_peers` of 1 or more), with the most groups any of its rows saw."""
    peers: dict[int, int] = {}
    for g in groups:
        for n, step in zip(g["num_peers"], g["outer_step_of_rows"]):
            if n:
                peers[step] = max(peers.get(step, 0), n)
    return sum(n == len(groups) for n in peers.values()), len(peers)


def clipped(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of `spans` inside [start, end]."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)


def arm_figures(
    name: str,
    groups: list[dict[str, Any]],
    cgroups: list[dict[str, Any]],
    solo: list[dict[str, Any]],
    counters: Counters | None = None,
    trio: str = "unequal",
    side_by_side: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """An arm's swarm figures from its groups' (see `group_figures`), the solo figures of the same cores, the
    sampler's counters (None: no CPU figures) and the trio's solo runs side by side (None: not measured).

    Its wall time runs from the first inner step of any group to the last outer step of any group. Throughput is
    measured over the part of it after every quota was set (`engage_when_ready`): the steps that began then.
    Where a group's time went (`time`): inner steps, rounds (each outer row's `averaging_s`, its wait included),
    evaluations (from the row before each eval row to it), after its own last round until the arm's, and the rest;
    and its step speed against solo split into CPU per step and cores inside the steps (`step_cpu`)."""
    start, end = min(g["steps"][0][0] for g in groups), max(g["end"] for g in groups)
    measured_from = max(start, *(c["engaged_at"] for c in cgroups))
    window, tokens_per_step = end - measured_from, groups[0]["tokens"] // groups[0]["inner_steps"]
    if window <= 0:
        raise BenchError(f"{name}: no step began after every CPU quota was set")
    for i, (g, alone) in enumerate(zip(groups, solo)):
        steps = g.pop("steps")
        g["measured_tokens"] = sum(t >= measured_from for t, _ in steps) * tokens_per_step
        g["tokens_per_s"] = g["measured_tokens"] / window
        steady = [(t, seconds) for t, seconds in steps[1:] if t >= measured_from] or [steps[0]]
        g["step_tokens_per_s"] = len(steady) * tokens_per_step / sum(seconds for _, seconds in steady)
        spans = [(t, t + seconds) for t, seconds in steady]
        in_window = [(t, t + seconds) for t, seconds in steps if t >= measured_from]
        rounds_s = clipped(g.pop("round_spans"), measured_from, end)
        g["eval_s"] = sum(after - before for before, after in g.pop("eval_spans") if start <= before and after <= end)
        after_s = end - g["end"]
        steps_s = clipped(in_window, measured_from, end)
        g["time"] = {
            "window_s": window, "steps_s": steps_s, "rounds_s": rounds_s, "eval_s": g["eval_s"], "after_s": after_s,
            "other_s": window - steps_s - rounds_s - g["eval_s"] - after_s,
            "train_cpu_s": counters.between("train", [(measured_from, end)], i) if counters else None,
            "helpers_cpu_s": counters.between("helpers", [(measured_from, end)], i) if counters else None,
            **step_cpu(counters, i, spans),
        }  # fmt: skip
        spent, solo_cpu, solo_cores = g["time"], alone.get("cpu_per_step_s"), alone.get("cores_in_steps")
        spent["step_speed_vs_solo"] = g["step_tokens_per_s"] / alone["tokens_per_s"]
        per_step, cores = spent["cpu_per_step_s"], spent["cores_in_steps"]
        spent["cpu_per_step_vs_solo"] = per_step / solo_cpu if per_step and solo_cpu else None
        spent["cores_vs_solo"] = cores / solo_cores if cores and solo_cores else None
        g["full_round_share"] = (sum(n == len(groups) for n in g["num_peers"] if n is not None) / g["rounds"]
                                 if g["rounds"] else None)  # fmt: skip
        g["evals"] = [(at - start, loss) for at, loss in g.pop("evals")]  # seconds since the arm's first step
        g["losses"] = [(round(at - start, 3), loss) for at, loss in g.pop("losses")]
        del g["end"]
    measured = sum(g["measured_tokens"] for g in groups)
    shas = {g["params_sha256"] for g in groups}
    full, rounds = swarm_rounds(groups)
    solo_sum = sum(s["tokens_per_s"] for s in solo)
    return {
        "name": name,
        "trio": trio,
        "cores": [s["cores"] for s in solo],
        "wall_s": end - start,
        "unthrottled_start_s": measured_from - start,  # left out of the throughput: a quota was not set yet
        "swarm_tokens": sum(g["tokens"] for g in groups),
        "swarm_tokens_per_s": measured / window,
        "solo_sum_tokens_per_s": solo_sum,
        "ratio_to_solo_sum": measured / window / solo_sum,
        "ratio_to_solo_runs": ratios_either_side(solo, measured / window),  # before the arms, after them
        "ratio_to_side_by_side_sum": (measured / window / sum(s["tokens_per_s"] for s in side_by_side)
                                      if side_by_side else None),  # fmt: skip
        "full_rounds": full,
        "swarm_rounds": rounds,
        "full_round_share": full / rounds if rounds else None,
        "discarded_steps": sum(g["discarded_steps"] for g in groups),
        "final_eval_loss": groups[0]["final_eval_loss"],
        "same_model": len(shas) == 1 and None not in shas,
        "machine": machine_figures(counters, measured_from, end, [s["cores"] for s in solo], groups),
        "groups": groups,
    }


def machine_figures(
    counters: Counters | None, start: float, end: float, cores: list[float], groups: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """Core-seconds over [start, end]: the machine's busy and stolen, the trainers' (inside their quotas), their
    helpers', the bootstrap DHT's, this bench's and everything else's, against the spare capacity the quotas leave."""
    if counters is None:
        return None
    window, span = end - start, [(start, end)]
    busy, trainers = counters.between("busy", span), sum(g["time"]["train_cpu_s"] for g in groups)
    helpers, dht = sum(g["time"]["helpers_cpu_s"] for g in groups), counters.between("dht", span)
    bench = counters.between("bench", span)
    return {
        "cores": usable_cores(),
        "quota_cores": sum(cores),
        "window_s": window,
        "capacity_core_s": usable_cores() * window,
        "spare_core_s": (usable_cores() - sum(cores)) * window,
        "busy_core_s": busy,
        "steal_core_s": counters.between("steal", span),
        "trainers_core_s": trainers,
        "helpers_core_s": helpers,
        "dht_core_s": dht,
        "bench_core_s": bench,
        "others_core_s": busy - trainers - helpers - dht - bench,  # other processes and the kernel's own work
        # (/proc/stat's ticks and the window's clock are read apart: a machine busy throughout can come out a few
        # hundredths of a core-second below zero)
        "idle_core_s": max(0.0, usable_cores() * window - busy - counters.between("steal", span)),
    }


# ---------------------------------------------------------------- targets


def arm_targets(arm: dict[str, Any]) -> dict[str, Any]:
    """An arm's three targets, each met or missed (None where not measured)."""
    share = arm["full_round_share"]
    return {
        "ratio": arm["ratio_to_solo_sum"],
        "ratio_met": arm["ratio_to_solo_sum"] >= RATIO_TARGET,
        "full_round_share": share,
        "full_rounds_met": None if share is None else share >= FULL_ROUNDS_TARGET,
        "discarded_steps": arm["discarded_steps"],
        "discarded_met": arm["discarded_steps"] <= DISCARD_TARGET,
    }


def eval_gap(arms: dict[str, dict[str, Any]], trio: str, versus: str) -> float | None:
    """tokens' final eval loss ÷ `versus`'s − 1 on `trio` (None where either did not run)."""
    token, other = arms.get(f"{trio}-tokens"), arms.get(f"{trio}-{versus}")
    if token is None or other is None or not token["final_eval_loss"] or not other["final_eval_loss"]:
        return None
    return token["final_eval_loss"] / other["final_eval_loss"] - 1


def targets(arms: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm its targets (`arm_targets`); per trio the tokens arm's final eval loss against fixed's and old-fixed's;
    and the decision rule: tokens becomes the default when on equal groups its loss is at most EVAL_GAP_TARGET above
    fixed's and on unequal ones below it (None where an arm it needs did not run)."""
    by_name = {f"{arm['trio']}-{arm['name']}": arm for arm in arms}
    gaps = {trio: {versus: eval_gap(by_name, trio, versus) for versus in ("fixed", "old-fixed")} for trio in TRIO_NAMES}
    equal, unequal = gaps["equal"]["fixed"], gaps["unequal"]["fixed"]
    equal_met = None if equal is None else equal <= EVAL_GAP_TARGET
    unequal_met = None if unequal is None else unequal < 0
    return {
        "ratio_target": RATIO_TARGET,
        "full_rounds_target": FULL_ROUNDS_TARGET,
        "discard_target": DISCARD_TARGET,
        "eval_gap_target": EVAL_GAP_TARGET,
        "arms": {name: arm_targets(arm) for name, arm in by_name.items()},
        "eval_gaps": gaps,
        "equal_eval_met": equal_met,
        "unequal_eval_met": unequal_met,
        "tokens_default": None if equal_met is None or unequal_met is None else equal_met and unequal_met,
    }


# ---------------------------------------------------------------- where the time went


def gap_split(groups: list[dict[str, Any]]) -> tuple[float, float] | None:
    """The step speed lost against solo (log ratio summed over groups), split into the share from more CPU per step
    and the share from fewer cores inside the steps: speed ÷ solo = (cores ÷ solo) ÷ (CPU per step ÷ solo). A factor
    that went the other way counts 0. None when the steps lost no speed in all (log ratios summed)."""
    per_step = [g["time"]["cpu_per_step_vs_solo"] for g in groups]
    cores = [g["time"]["cores_vs_solo"] for g in groups]
    if None in per_step or None in cores or any(v <= 0 for v in per_step + cores):
        return None
    from_cpu = sum(math.log(v) for v in per_step)  # > 0: each step cost more CPU
    from_cores = -sum(math.log(v) for v in cores)  # > 0: fewer cores per second inside the steps
    if from_cpu + from_cores <= 0:
        return None  # together at solo speed or faster: no gap
    from_cpu, from_cores = max(from_cpu, 0.0), max(from_cores, 0.0)  # the other factor, if any, made up some of it
    return from_cpu / (from_cpu + from_cores), from_cores / (from_cpu + from_cores)


def explain_arm(arm: dict[str, Any], solo: list[dict[str, Any]]) -> str:
    """One line: the arm's step speeds against solo, what they split into, and the CPU outside the quotas against
    the spare capacity they leave."""
    groups, m = arm["groups"], arm["machine"]
    t = [g["time"] for g in groups]
    quota = " / ".join(f"{c:g}" for c in arm["cores"])
    moments = "/".join(sorted({g.get("moment") or "unknown" for g in groups}))
    words = [
        f"{arm['trio']} {arm['name']} (inner AdamW moment {moments}): inner steps at "
        f"{slashed([x['step_speed_vs_solo'] for x in t])} of solo speed; "
        f"per step the training process used {slashed([x['cpu_per_step_vs_solo'] for x in t])}× its solo CPU "
        f"(main thread {slashed([x['main_share'] for x in t], '.0%')} of it; solo "
        f"{slashed([s.get('main_share') for s in solo], '.0%')}) and ran at "
        f"{slashed([x['cores_in_steps'] for x in t])} cores inside its steps (quota {quota}; solo "
        f"{slashed([s.get('cores_in_steps') for s in solo])})"
    ]
    split = gap_split(groups)
    if split is not None:
        words[-1] += f": {split[0]:.0%} of the gap is more CPU per step, {split[1]:.0%} fewer cores per second"
    if m is None:
        return words[0] + "."
    outside = m["helpers_core_s"] + m["dht_core_s"] + m["bench_core_s"] + m["others_core_s"]
    stolen = m["steal_core_s"] > 0.05 * m["capacity_core_s"]
    words.append(
        f"helpers (DHT, p2pd, averager) used {m['helpers_core_s']:.1f} core-s, the bootstrap DHT "
        f"{m['dht_core_s']:.1f}, this bench {m['bench_core_s']:.1f}, other processes and the kernel "
        f"{m['others_core_s']:.1f}: {outside:.1f} core-s outside the quotas against their spare capacity of "
        f"{m['spare_core_s']:.1f} (({m['cores']} − {m['quota_cores']:g}) cores × {m['window_s']:.0f} s); the "
        f"machine sat idle {m['idle_core_s']:.1f} core-s ({m['idle_core_s'] / m['capacity_core_s']:.0%})"
        + (f", the hypervisor took {m['steal_core_s']:.1f}" if stolen else "")
    )
    trained = sum(x["steps_s"] for x in t)
    rest = [f"{sum(x[k] for x in t):.1f} s {label}" for k, label in
            (("rounds_s", "in rounds"), ("eval_s", "in evaluations"), ("after_s", "after a group's last round"),
             ("other_s", "elsewhere"))]  # fmt: skip
    words.append(f"summed over the groups, {trained:.1f} s in inner steps, {', '.join(rest)}")
    return "; ".join(words) + "."


def moment_cost(arms: dict[str, dict[str, Any]], trio: str) -> str | None:
    """The galaxy moment's CPU per step: the tokens-galaxy arm's ÷ the tokens arm's, per group (None without
    both)."""
    galaxy, default = arms.get(f"{trio}-tokens-galaxy"), arms.get(f"{trio}-tokens")
    if galaxy is None or default is None:
        return None
    ratios = [a["time"]["cpu_per_step_s"] / b["time"]["cpu_per_step_s"]
              if a["time"]["cpu_per_step_s"] and b["time"]["cpu_per_step_s"] else None
              for a, b in zip(galaxy["groups"], default["groups"])]  # fmt: skip
    moments = [f"{g.get('moment')} / {h.get('moment')}" for g, h in zip(galaxy["groups"], default["groups"])]
    return (f"{trio}: an inner step of tokens-galaxy (inner AdamW moment {moments[0]} in tokens-galaxy / tokens) "
            f"took {slashed(ratios)}× the CPU of the same step in tokens (`--hv.inner-moment auto`): what the "
            "galaxy moment's two halves of a lone micro-batch cost per step, measured")  # fmt: skip


def explain(result: dict[str, Any]) -> list[str]:
    """Per tokens arm (and its galaxy-moment twin), where its throughput went (`explain_arm`), and what the inner
    moment cost per step where both ran (`moment_cost`)."""
    lines = []
    for arm in result["arms"]:
        if arm["name"].startswith("tokens"):
            solo = [next(s for s in result["solo"] if s["cores"] == c) for c in arm["cores"]]
            lines.append(explain_arm(arm, solo))
    by_name = {arm_key(arm): arm for arm in result["arms"]}
    lines += [line + "." for trio in TRIO_NAMES if (line := moment_cost(by_name, trio))]
    lines += [line for trio in TRIO_NAMES if (line := side_by_side_line(result, trio))]
    return lines + [line for line in [drift_line(result["solo"])] if line]


def side_by_side_line(result: dict[str, Any], trio: str) -> str | None:
    """What the trio's three trainers lose by sharing the machine with no swarm (their solo runs at once against
    each alone), and what the swarm arms reach of that (None where the side-by-side runs did not take place)."""
    together = result.get("side_by_side", {}).get(trio)
    if not together:
        return None
    alone = [next(s for s in result["solo"] if s["cores"] == side["cores"]) for side in together]
    speeds = [side["tokens_per_s"] / solo["tokens_per_s"] for side, solo in zip(together, alone)]
    per_step = [side["cpu_per_step_s"] / solo["cpu_per_step_s"] if side.get("cpu_per_step_s") and
                solo.get("cpu_per_step_s") else None for side, solo in zip(together, alone)]  # fmt: skip
    total, total_alone = sum(s["tokens_per_s"] for s in together), sum(s["tokens_per_s"] for s in alone)
    reached = [f"{arm['name']} {arm['ratio_to_side_by_side_sum']:.2f}" for arm in result["arms"]
               if arm["trio"] == trio and arm.get("ratio_to_side_by_side_sum") is not None]
    return (f"{trio} trio side by side (its three solo runs at once, no swarm): {total:.0f} tokens/s, "
            f"{total / total_alone:.2f} of the sum alone; each at {slashed(speeds)} of its solo speed, "
            f"{slashed(per_step)}× its CPU per step: what sharing this machine costs before any swarm. Against this "
            f"sum the arms reach {', '.join(reached)}.")


# ---------------------------------------------------------------- the section


def setup_lines(result: dict[str, Any]) -> list[str]:
    """Bullets: machine, command, what each phase ran."""
    s, load = result["setup"], f"{result['machine']['load_avg_1m']:.1f} / {result['load_avg_1m_end']:.1f}"
    trios = "; ".join(f"{trio} {' / '.join(f'{c:g}' for c in cores)}" for trio, cores in result["trios"].items())
    flags = "; ".join(f"{arm} `{' '.join(f)}`" for arm, f in result["arm_flags"].items())
    ran = ", ".join(arm_key(arm) for arm in result["arms"])
    return [
        f"- machine: {machine_line(result['machine'])}",
        f"- command: `{result['command']}`",
        f"- 3 worker groups of 1 rank (`python -m diloco.train`) on loopback, each in a cgroup v1 `cpu` of its own "
        f"holding its training process, shares of a core: {trios} (`cpu.cfs_quota_us` ÷ `cpu.cfs_period_us`); its "
        "DHT, p2pd and averager move to a second cgroup of the group's without a quota (counted, not held: a slower "
        "accelerator, not a slower host) when the quota is set, once the trainer has created metrics.jsonl "
        "(imports, model and swarm join at full speed; only steps that began after it are counted); the bootstrap "
        "`diloco dht` in a cgroup without a quota",
        f"- model {result['model']}, {result['data']} with the byte tokenizer, {s['tokens_per_step']} tokens per "
        f"inner step (seq {s['seq_length']} × batch {s['batch']}), float32, one torch thread per process",
        f"- solo: each group alone, galaxy size 1 (no DHT), "
        f"{'all three at once (quick: a smoke test)' if result['quick'] else SOLO_ORDER}, {s['solo_steps']} "
        f"inner steps for the fastest and fewer for slower ones; tokens/s over the steps after {s['skip']} warm-up "
        "steps (harmonic mean of the rows' `tokens_per_s`); the equal trio's solo is the middle group's; solo side "
        "by side: each trio's three solo runs at once, each under its quota (what sharing the machine costs three "
        "trainers before any swarm)",
        f"- arms ({ran}): {flags}; each with `--max-steps {s['steps']} --hv.local-steps {s['local_steps']}` (the "
        f"token budget: {s['target_tokens']} tokens, H × 3 × tokens per step) and the outer SGD pinned at lr 1.0, "
        "momentum 0 (its lr warm-up as `auto` picks it); every other flag at its default (the inner AdamW moment "
        f"`auto`: plain AdamW, as a step is one micro-batch); one eval of {s['eval_steps']} batches at the end "
        "(none during the run, as in the solo runs)",
        "- wall: from the arm's first inner step to its last outer step; tokens/s: the tokens of the steps that "
        "began once every quota was set ÷ the wall from then on (rounds included); step tokens/s: its tokens ÷ the "
        "time inside its inner steps (first step left out); idle = the sum of the outer rows' `wait_s`; rounds: "
        "their `averaging_s`; full rounds: the share of a group's rounds (outer rows with `num_peers`), or of the "
        "swarm's outer steps, that had all 3 groups; discarded / carried: inner steps thrown away (summary.json) / "
        "kept through a load (the rows' `carried_steps`)",
        "- CPU: the cgroups' `cpuacct.usage`, the trainer's main thread (/proc), the machine (/proc/stat) read every "
        "0.1 s and integrated over each group's inner steps and over the arm's measured wall",
        f"- 1-minute load average at start / end: {load}",
        "- the mixed-shape arm (a 1-rank and a 2-rank group, identical after every round, round time against two "
        "1-rank groups) is `diloco bench shapes`",
    ]


def group_rows(result: dict[str, Any]) -> list[str]:
    """One table row per (arm, group)."""
    lines = []
    for arm in result["arms"]:
        for i, g in enumerate(arm["groups"]):
            cg = result["cgroups"][arm_key(arm)][i]
            solo = next(s for s in result["solo"] if s["cores"] == arm["cores"][i])
            cells = [arm["trio"], arm["name"], str(i), f"{arm['cores'][i]:g}", f"{solo['tokens_per_s']:.0f}",
                     f"{g['tokens_per_s']:.0f}", f"{g['tokens_per_s'] / solo['tokens_per_s']:.2f}",
                     f"{g['step_tokens_per_s']:.0f}", str(g["inner_steps"]), ", ".join(map(str, g["steps_per_round"])),
                     str(g["discarded_steps"]), str(g["carried_steps"]), fmt(g["full_round_share"], ".0%"),
                     fmt(g["wait_s"]), f"{g['averaging_s']:.1f}", f"{g['eval_s']:.1f}", fmt(cg["cpu_s"]),
                     fmt(g["time"]["helpers_cpu_s"]), f"{cg['throttled_periods']}/{cg['periods']}"]  # fmt: skip
            lines.append(row(cells))
    return lines


def arm_rows(result: dict[str, Any]) -> list[str]:
    lines, gaps = [], result["targets"]["eval_gaps"]
    for arm in result["arms"]:
        gap = gaps[arm["trio"]]["fixed"] if arm["name"] == "tokens" else None
        cells = [arm["trio"], arm["name"], f"{arm['wall_s']:.1f}", f"{arm['unthrottled_start_s']:.2f}",
                 f"{arm['swarm_tokens']:,}", f"{arm['swarm_tokens_per_s']:.0f}", f"**{arm['ratio_to_solo_sum']:.2f}**",
                 fmt(arm.get("ratio_to_side_by_side_sum"), ".2f"),
                 f"{arm['full_rounds']}/{arm['swarm_rounds']} ({fmt(arm['full_round_share'], '.0%')})",
                 str(arm["discarded_steps"]), fmt(arm["final_eval_loss"], ".4f"), fmt(gap, "+.2%"),
                 "yes" if arm["same_model"] else "no"]  # fmt: skip
        lines.append(row(cells))
    return lines


def time_rows(result: dict[str, Any]) -> list[str]:
    """Where each group's time went, per arm: speed against solo, its split, the CPU in and beside the quota."""
    lines = []
    for arm in result["arms"]:
        for i, g in enumerate(arm["groups"]):
            t = g["time"]
            solo = next(s for s in result["solo"] if s["cores"] == arm["cores"][i])
            cells = [arm["trio"], arm["name"], str(i), f"{arm['cores'][i]:g}", fmt(t["step_speed_vs_solo"], ".2f"),
                     fmt(t["cpu_per_step_vs_solo"], ".2f"),
                     f"{fmt(t['cores_in_steps'], '.2f')} ({fmt(solo.get('cores_in_steps'), '.2f')})",
                     f"{fmt(t['main_share'], '.0%')} ({fmt(solo.get('main_share'), '.0%')})",
                     fmt(t["throttled_share_in_steps"], ".0%"), f"{t['steps_s']:.1f}", f"{t['rounds_s']:.1f}",
                     f"{t['eval_s']:.1f}", f"{t['after_s']:.1f}", f"{t['other_s']:.1f}", fmt(t["train_cpu_s"]),
                     fmt(t["helpers_cpu_s"])]  # fmt: skip
            lines.append(row(cells))
    return lines


def machine_rows(result: dict[str, Any]) -> list[str]:
    lines = []
    for arm in result["arms"]:
        m = arm["machine"]
        if m is None:
            continue
        cells = [arm["trio"], arm["name"], f"{m['window_s']:.1f}", f"{m['quota_cores']:g}",
                 f"{m['spare_core_s']:.1f}", f"{m['trainers_core_s']:.1f}", f"{m['helpers_core_s']:.1f}",
                 f"{m['dht_core_s']:.1f}", f"{m['bench_core_s']:.1f}", f"{m['others_core_s']:.1f}",
                 f"{m['idle_core_s']:.1f}", f"{m['steal_core_s']:.1f}"]  # fmt: skip
        lines.append(row(cells))
    return lines


def side_note(arm: dict[str, Any]) -> str:
    """", X of Σ solo side by side" where measured."""
    ratio, runs = arm.get("ratio_to_side_by_side_sum"), arm.get("ratio_to_solo_runs")
    either = "" if not runs else f"; {runs['before']:.2f} / {runs['after']:.2f} of Σ solo before / after the arms"
    return either + ("" if ratio is None else f"; {ratio:.2f} of Σ solo side by side")


def verdict(result: dict[str, Any]) -> str:
    """Every arm's targets, met or missed; the tokens arm's eval loss against fixed per trio; the decision."""
    t = result["targets"]
    words = [f"Sum of solo tokens/s (unequal): {result['solo_sum_tokens_per_s']:.0f}; fixed H is expected at about "
             f"3 × slowest ÷ sum = {result['fixed_h_expected_ratio']:.2f} of it."]  # fmt: skip
    for arm in result["arms"]:
        a = t["arms"][arm_key(arm)]
        words.append(
            f"{arm['trio']} {arm['name']}: swarm ÷ Σ solo {a['ratio']:.2f} (≥ {t['ratio_target']}: "
            f"**{MET[a['ratio_met']]}**{side_note(arm)}), full rounds {fmt(a['full_round_share'], '.0%')} "
            f"(≥ {t['full_rounds_target']:.0%}: **{MET[a['full_rounds_met']]}**), discarded steps "
            f"{a['discarded_steps']} (= {t['discard_target']}: **{MET[a['discarded_met']]}**), final eval loss "
            f"{fmt(arm['final_eval_loss'], '.4f')}."
        )
    for trio, gaps in t["eval_gaps"].items():
        if gaps["fixed"] is not None:
            rule = f"≤ +{t['eval_gap_target']:.0%}" if trio == "equal" else "< 0"
            met = t["equal_eval_met"] if trio == "equal" else t["unequal_eval_met"]
            old = f", {gaps['old-fixed']:+.2%} against old-fixed" if gaps["old-fixed"] is not None else ""
            words.append(f"Tokens on {trio} groups: final eval loss {gaps['fixed']:+.2%} against fixed ({rule}: "
                         f"**{MET[met]}**){old}.")  # fmt: skip
    if t["tokens_default"] is None:
        words.append("Decision: not measured (the equal and unequal fixed and tokens arms are all needed).")
    else:
        words.append(f"Decision: `--hv.pace tokens` as the default: **{'yes' if t['tokens_default'] else 'no'}** "
                     "(no worse than +1% on equal groups and better on unequal ones).")  # fmt: skip
    return " ".join(words)


def markdown(result: dict[str, Any]) -> str:
    """A dated section: setup, per-group and per-arm tables, where the time went, the targets and the decision."""
    lines = [f"## {result['bench']}{' (quick)' if result['quick'] else ''}: {result['date']}", ""]
    lines += setup_lines(result)
    if "plot" in result:
        lines += ["", f"![training loss and tokens/s per group]({result['plot']})"]
    lines += [
        "",
        "| trio | arm | group | cores | solo tokens/s | swarm tokens/s | swarm ÷ solo | step tokens/s in swarm | "
        "inner steps | steps per round | discarded | carried | full rounds | idle (s) | rounds (s) | evals (s) | "
        "CPU under quota (s) | helpers CPU (s) | throttled periods |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *group_rows(result),
        "",
        "| trio | arm | wall (s) | before every quota (s) | swarm tokens | swarm tokens/s | ÷ sum of solo | "
        "÷ sum of solo side by side | full rounds | discarded | final eval loss | tokens vs fixed | same model |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
        *arm_rows(result),
        "",
        "Where the time went, per group (over the measured wall; CPU in core-seconds): step speed ÷ solo = cores in "
        "steps ÷ solo's, ÷ CPU per step ÷ solo's; main thread: its share of the training process's CPU in steps; "
        "throttled: the share of CFS periods in steps in which the kernel parked it.",
        "",
        "| trio | arm | group | quota | step speed ÷ solo | CPU per step ÷ solo | cores in steps (solo) | "
        "main thread (solo) | throttled in steps | steps (s) | rounds (s) | evals (s) | after its last round (s) | "
        "other (s) | trainer CPU | helpers CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *time_rows(result),
        "",
        "| trio | arm | wall measured (s) | quota cores | spare core-s | trainers | helpers | bootstrap DHT | bench | "
        "others | idle | stolen |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *machine_rows(result),
        "",
        *[f"- {line}" for line in explain(result)],
        *(dead_lines(result["dead"], " ".join(result["dead"]["flags"])) if "dead" in result else []),
        *(pause_lines(result["pause"], " ".join(result["pause"]["flags"])) if result.get("pause") else []),
        "",
        verdict(result),
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], out: Path) -> Path:
    """hetero[-quick].png in `out`: group 0's training loss against seconds since each arm's first inner step (a
    moving average over 5 steps; the arms evaluate only at the end), one panel per trio, and every unequal group's
    tokens/s alone and in each arm."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    trios = list(dict.fromkeys(arm["trio"] for arm in result["arms"]))
    fig, axes = plt.subplots(1, len(trios) + 1, figsize=(5.5 * (len(trios) + 1), 4))
    for curve, trio in zip(axes, trios):
        for arm in (a for a in result["arms"] if a["trio"] == trio):
            losses = arm["groups"][0]["losses"]
            windows = [[loss for _, loss in losses[max(0, i - 4) : i + 1]] for i in range(len(losses))]
            smooth = [sum(w) / len(w) for w in windows]
            curve.plot([t for t, _ in losses], smooth, label=f"{arm['name']} (final eval {arm['final_eval_loss']:.3f})")
        cores = " / ".join(f"{c:g}" for c in result["trios"][trio])
        curve.set(xlabel="seconds since the arm's first inner step", ylabel="training loss, group 0",
                  title=f"loss, {trio} ({cores} core)")  # fmt: skip
        curve.legend()
    bars = axes[-1]
    series = [("solo", [s["tokens_per_s"] for s in result["solo"]])]
    series += [(arm["name"], [g["tokens_per_s"] for g in arm["groups"]]) for arm in result["arms"]
               if arm["trio"] == "unequal"]  # fmt: skip
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series):
        bars.bar([i + k * width for i in range(len(values))], values, width, label=name)
    bars.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(result["cores"]))])
    bars.set_xticklabels([f"group {i}\n{c:g} core" for i, c in enumerate(result["cores"])])
    bars.set(ylabel="tokens/s", title="tokens/s per group, unequal trio")
    bars.legend()
    fig.tight_layout()
    path = out / f"hetero{'-quick' if result['quick'] else ''}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

"""`diloco bench poison`: what one hostile worker group does to the model under each `--hv.aggregation`.

The convergence bench's workload (real text, byte tokenizer, its ~1M-parameter llama, S = 200 inner steps per
group, H = 25, the outer setting `auto` picks for k = 4) with four honest groups, and the same swarm plus a fifth
group that trains like them but forges what it sends (`diloco.bench.attacks`: 50× its pseudo-gradient,
sign-flipped, noise at its norm; each under the norm screen's 100×), or also the weight it announces (`heavy`:
sign-flipped at 1e30, which every member caps at 16× the median weight; with the mean and no cap its part would be
the result). The honest groups see the same data with or without it (equal tokens). Per aggregation rule and
attack: the held-out loss of the honest groups' final model against the same swarm without the attacker, and
against the mean without the attacker (what a robust rule costs when nobody attacks). Target: every robust rule
within 2% of the attack-free mean for every attack.

Groups run as threads averaging through the in-memory swarm, whose robust rules are the reducers' own
(`diloco.swarm.rounds.aggregation`, part by part as over TCP); arms run in parallel processes, one per usable core.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from diloco.bench import section_head
from diloco.bench.attacks import ATTACKS, HEAVY, SCALE
from diloco.bench.convergence import ArmSpec, Workload, load_corpus, run_all, workload
from diloco.bench.convergence_report import workload_text
from diloco.bench.models import model_folder
from diloco.model import load_model
from diloco.outer.auto import auto_outer
from diloco.swarm.rounds.aggregation import AGGREGATIONS
from diloco.swarm.rounds.screening import MAX_WEIGHT_RATIO

__all__ = ["markdown", "measure", "plot"]

K = 4  # honest groups
TARGET = 0.02  # a robust rule under attack: within 2% of the attack-free mean's eval loss
NONE = "none"  # the arm without an attacker
QUICK_ATTACKS = ("scaled", "heavy")  # a smoke run: one forged value, one forged weight


def attack_names(quick: bool) -> tuple[str, ...]:
    return QUICK_ATTACKS if quick else tuple(ATTACKS)


def arm_name(rule: str, attack: str) -> str:
    return f"{rule}/{attack}"


def specs(w: Workload, quick: bool) -> list[ArmSpec]:
    """Per seed, rule and attack (and no attack): one arm of K honest groups (+ the attacker)."""
    h = 5 if quick else 25
    setting = auto_outer(h, K, w.warmup_steps, w.steps)
    arms = []
    for seed in w.seeds:
        for rule in AGGREGATIONS:
            for attack in (NONE, *attack_names(quick)):
                hostile = "" if attack == NONE else attack
                arms.append(ArmSpec(arm_name(rule, attack), K, K + bool(hostile), w.batch, w.steps, h,
                                    (setting.lr, setting.momentum), outer_warmup=setting.warmup, seed=seed,
                                    aggregation=rule, attack=hostile))  # fmt: skip
    return arms


def measure(quick: bool, work_dir: Path, info: dict[str, Any], data: Path) -> dict[str, Any]:
    w = workload(quick)
    w = replace(w, model=model_folder(w.model, work_dir / "models"))
    load_corpus(w, data)  # a bad --data fails here, once, not in every worker
    arms = specs(w, quick)
    runs, workers = run_all(arms, w, data, info)
    params = sum(p.numel() for p in load_model(w.model, 0).parameters())
    first = arms[0]
    return {
        "workload": asdict(w) | {"model": str(w.model), "corpus": str(data.resolve()), "parameters": params},
        "honest_groups": K, "h": first.h, "outer": [*first.outer, first.outer_warmup], "scale": SCALE,
        "workers": workers, "attacks": list(attack_names(quick)), **summarize(runs, attack_names(quick)),
    }  # fmt: skip


def summarize(runs: list[dict[str, Any]], attacks: tuple[str, ...]) -> dict[str, Any]:
    """Per arm: eval loss per seed and its gaps (per seed, then averaged) to the same rule without the attacker
    and to the mean without it; per robust rule: its worst gap under attack and the verdict."""
    loss = {(r["name"], r["seed"]): r["final_eval_loss"] for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    arms = []
    for rule in AGGREGATIONS:
        for attack in (NONE, *attacks):
            name = arm_name(rule, attack)
            losses = [loss[name, s] for s in seeds]
            vs_rule = [loss[name, s] / loss[arm_name(rule, NONE), s] - 1 for s in seeds]
            vs_mean = [loss[name, s] / loss[arm_name("mean", NONE), s] - 1 for s in seeds]
            ran = [r for r in runs if r["name"] == name]
            arms.append({
                "name": name, "aggregation": rule, "attack": attack, "groups": ran[0]["groups"],
                "final_eval_loss": losses, "mean_eval_loss": float(np.mean(losses)),
                "gap_vs_same_rule": float(np.mean(vs_rule)),
                "gap_vs_mean": float(np.mean(vs_mean)), "gap_vs_mean_by_seed": vs_mean,
                "groups_identical": all(r["groups_identical"] for r in ran), "curve": ran[0]["curve"],
                "wall_s": sum(r["wall_s"] for r in ran),
            })  # fmt: skip
    verdicts = {}
    for rule in AGGREGATIONS:
        attacked = [a for a in arms if a["aggregation"] == rule and a["attack"] != NONE]
        worst = max(max(a["gap_vs_mean_by_seed"]) for a in attacked)
        verdicts[rule] = {"worst_gap_under_attack": worst, "met": worst <= TARGET,
                          "cost_without_attacker": next(a["gap_vs_mean"] for a in arms
                                                        if a["name"] == arm_name(rule, NONE))}  # fmt: skip
    return {"seeds": seeds, "arms": arms, "target": TARGET, "verdicts": verdicts}


def markdown(result: dict[str, Any]) -> str:
    lr, momentum, warmup = result["outer"]
    lines = [
        *section_head(result),
        f"- the convergence bench's workload: {workload_text(result['workload'])}; {result['honest_groups']} honest "
        f"groups, H = {result['h']}, outer lr {lr:g} (warm-up over {warmup} outer steps), momentum {momentum:g} (auto "
        "for k = 4)",
        f"- attacker: a fifth group that trains like the others (on group 0's data) and sends, every round, "
        f"{result['scale']:g}× its pseudo-gradient (scaled), minus it (sign-flip) or Gaussian noise at its norm "
        f"(noise), or minus it announced with a weight of {HEAVY:g} (heavy: counted at the cap, "
        f"{MAX_WEIGHT_RATIO:g}× the median weight); the honest groups' data is the same with and without it",
        "- groups are threads of one process averaging through the in-memory swarm with the reducers' rules, part "
        f"by part; arms in {result['workers']} parallel processes of one torch thread",
        f"- 1-minute load average at start / end: {result['machine']['load_avg_1m']:.1f} / "
        f"{result['load_avg_1m_end']:.1f} (the losses do not depend on it)",
        "",
        "| aggregation | attack | final eval loss per seed | mean | vs the same rule, no attacker | vs mean, no "
        "attacker | groups identical |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for a in result["arms"]:
        losses = ", ".join(f"{v:.4f}" for v in a["final_eval_loss"])
        lines.append(f"| {a['aggregation']} | {a['attack']} | {losses} | {a['mean_eval_loss']:.4f} | "
                     f"{a['gap_vs_same_rule'] * 100:+.2f}% | {a['gap_vs_mean'] * 100:+.2f}% | "
                     f"{a['groups_identical']} |")  # fmt: skip
    lines.append("")
    for rule, v in result["verdicts"].items():
        verdict = "meets" if v["met"] else "misses"
        lines.append(f"- {rule}: worst gap under attack {v['worst_gap_under_attack'] * 100:+.2f}% (any seed) vs the "
                     f"attack-free mean: **{verdict}** the {result['target'] * 100:.0f}% target; without an "
                     f"attacker {v['cost_without_attacker'] * 100:+.2f}% vs the mean")  # fmt: skip
    if "plot" in result:
        lines += ["", f"![eval loss per aggregation and attack]({result['plot']})"]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], out: Path) -> Path:
    """Final eval loss per aggregation rule (groups of bars) and attack (bars), the first seed's curves beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attacks = [NONE, *result.get("attacks", ATTACKS)]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(attacks)
    for i, attack in enumerate(attacks):
        arms = [a for a in result["arms"] if a["attack"] == attack]
        xs = [j + i * width for j in range(len(arms))]
        bars.bar(xs, [a["mean_eval_loss"] for a in arms], width, label=attack)
    bars.set_xticks([j + 0.4 - width / 2 for j in range(len(AGGREGATIONS))], list(AGGREGATIONS))
    clean = next(a["mean_eval_loss"] for a in result["arms"] if a["name"] == arm_name("mean", NONE))
    bars.axhline(clean * (1 + result["target"]), color="k", ls=":", lw=1, label="mean, no attacker + 2%")
    bars.set_ylim(clean * 0.95, min(max(a["mean_eval_loss"] for a in result["arms"]), clean * 1.6))
    bars.set(ylabel="final held-out loss (mean over seeds)", title="final eval loss (axis cut at +60%)")
    bars.legend(fontsize=8)
    for a in result["arms"]:
        if a["attack"] in (NONE, "scaled"):
            tokens, losses = zip(*a["curve"])  # all groups' tokens: the honest groups' share
            honest = result["honest_groups"] / a["groups"]
            curves.plot([t * honest / 1e6 for t in tokens], losses, "-" if a["attack"] == NONE else "--", marker=".",
                        label=a["name"])  # fmt: skip
    curves.set(xlabel="training tokens of the honest groups (millions)", ylabel="held-out loss",
               title="eval loss, first seed")  # fmt: skip
    curves.set_yscale("log")  # the mean under a scaled attack ends far above the rest
    curves.legend(fontsize=8)
    for ax in (bars, curves):
        ax.grid(alpha=0.3)
    fig.suptitle(f"poison, {result['date']}")
    fig.tight_layout()
    path = out / f"poison{'-quick' if result['quick'] else ''}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

"""The figures of `diloco bench convergence` from its runs: arms over seeds, gaps to DDP, the verdicts on the
defaults, the map's best setting per (k, H), its section and its plot."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from diloco.bench import section_head

Setting = tuple[float, float, int]  # (outer lr, outer momentum, outer-lr warm-up in outer steps)
PAPER: Setting = (0.7, 0.9, 0)  # the map's first columns
PLAIN: Setting = (1.0, 0.0, 0)
TARGET_GAP = {2: 0.02, 4: 0.03}  # no outer flags at H = 25: within 2% of DDP's eval loss at k = 2, 3% at k = 4


def summarize(runs: list[dict[str, Any]], specs: list[Any], study: str) -> dict[str, Any]:
    """The arms (runs of one name and k over seeds, in the order of `specs`), their gaps to the DDP run of the same
    k and seed, and the study's verdicts."""
    order = list(dict.fromkeys((s.k, s.name) for s in specs))
    arms = [_arm([r for r in runs if (r["k"], r["name"]) == key]) for key in order]
    refs = reference_ddp(arms)
    ddp = {(k, seed): loss for k, a in refs.items() for seed, loss in zip(a["seeds"], a["final_eval_loss"])}
    for arm in arms:
        gaps = [loss / ddp[arm["k"], seed] - 1 for seed, loss in zip(arm["seeds"], arm["final_eval_loss"])]
        arm["gap_by_seed"] = gaps
        arm["gap_vs_ddp"] = float(np.mean(gaps))
        arm["worst_gap"] = max(gaps)
    out = {"arms": arms, "ddp": {str(k): a["name"] for k, a in refs.items()}}
    if study == "map":
        return out | {"map": grid(arms)}
    if study == "streaming":
        return out | {"vs_blocking": vs_blocking(runs)}
    return out | {"target": target(arms), "m1": m1(arms)}


def is_ddp(arm: dict[str, Any]) -> bool:
    """A DDP arm of the study's batch and length, at the workload's inner schedule (`ddp`) or another (`ddp-lr…`)."""
    return re.fullmatch(r"ddp(-lr\S+)?", arm["name"]) is not None


def is_auto(arm: dict[str, Any]) -> bool:
    """DiLoCo with no outer flags (auto), at the workload's inner schedule or another (`…-auto-lr…`)."""
    return re.fullmatch(r"diloco-H\d+-auto(-lr\S+)?", arm["name"]) is not None


def best_per_k(arms: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per k, the arm of the lowest mean eval loss (arms of one k run on the same seeds, so their means compare)."""
    best: dict[int, dict[str, Any]] = {}
    for arm in arms:
        if arm["k"] not in best or arm["mean_eval_loss"] < best[arm["k"]]["mean_eval_loss"]:
            best[arm["k"]] = arm
    return best


def reference_ddp(arms: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per k, the DDP arm every gap is measured against: DDP at its best inner schedule of those run."""
    return best_per_k([a for a in arms if is_ddp(a)])


def vs_blocking(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per fragment arm of the streaming study: its eval loss ÷ the blocking arm's of the same seed − 1, averaged
    over the seeds."""
    blocking = {r["seed"]: r["final_eval_loss"] for r in runs if r["name"].endswith("-auto")}
    gaps: dict[str, list[float]] = {}
    for r in runs:
        if r["name"].startswith("streaming-"):
            gaps.setdefault(r["name"], []).append(r["final_eval_loss"] / blocking[r["seed"]] - 1)
    return {name: float(np.mean(values)) for name, values in gaps.items()}


def _arm(runs: list[dict[str, Any]]) -> dict[str, Any]:
    kept = ("name", "k", "groups", "batch", "steps", "h", "outer", "outer_warmup", "lr", "warmup_steps", "trial",
            "tokens", "fragments", "layout", "overlap", "mix", "inner_moment")  # fmt: skip
    return arm_figures(runs, kept)


def arm_figures(runs: list[dict[str, Any]], kept: tuple[str, ...]) -> dict[str, Any]:
    """One arm over its seeds' runs: the first seed's `kept` fields, every seed's eval loss, their mean and spread,
    the first seed's curve, the wall time summed."""
    runs = sorted(runs, key=lambda r: r["seed"])
    first, losses = runs[0], [r["final_eval_loss"] for r in runs]
    return {key: first[key] for key in kept} | {
        "seeds": [r["seed"] for r in runs],
        "final_eval_loss": losses,
        "mean_eval_loss": float(np.mean(losses)),
        "spread": float(max(losses) - min(losses)),
        "groups_identical": all(r["groups_identical"] for r in runs),
        "curve": first["curve"],  # the first seed's
        "wall_s": sum(r["wall_s"] for r in runs),
    }


def _moment(arm: dict[str, Any]) -> str:
    """What the outer column adds for an arm whose inner AdamW took the galaxy's second moment."""
    return ", galaxy moment" if arm.get("inner_moment") == "galaxy" else ""


def _setting(arm: dict[str, Any]) -> Setting | None:
    return None if arm["outer"] is None else (*arm["outer"], arm["outer_warmup"])


def target(arms: list[dict[str, Any]]) -> dict[str, Any]:
    """Per k: DiLoCo with no outer flags (auto) at its best inner schedule against the target, on its worst seed."""
    verdicts = {}
    for k, arm in sorted(best_per_k([a for a in arms if is_auto(a)]).items()):
        limit = TARGET_GAP.get(k)
        verdicts[str(k)] = {
            "arm": arm["name"],
            "setting": list(_setting(arm) or ()),
            "gap_vs_ddp": arm["gap_vs_ddp"],
            "worst_gap": arm["worst_gap"],
            "max_gap": limit,
            "met": None if limit is None else arm["worst_gap"] <= limit,
        }
    return {"h": next(a["h"] for a in arms if is_auto(a)), "by_k": verdicts}


def m1(arms: list[dict[str, Any]]) -> dict[str, Any]:
    """DiLoCo with one group against DDP and against one plain worker at equal tokens, per k."""
    out = {}
    for arm in arms:
        if arm["name"].startswith("m1-"):
            single = next(a for a in arms if a["k"] == arm["k"] and a["name"] == "single")
            out[str(arm["k"])] = {
                "vs_ddp": arm["gap_by_seed"][0],
                "vs_single": arm["final_eval_loss"][0] / single["final_eval_loss"][0] - 1,
            }
    return out


def grid(arms: list[dict[str, Any]]) -> dict[str, Any]:
    """The map: at every (k, H) the gap of each outer setting and of auto (what the trainer picks with no outer
    flags; it may be one of the others), the best of them, and each one's worst gap over the cells that ran it."""
    cells: dict[str, dict[str, Any]] = {}
    fixed: set[Setting] = set()  # the settings run as themselves somewhere: the table's columns
    for arm in arms:
        outer = _setting(arm)
        if outer is None:
            continue
        cell = cells.setdefault(f"{arm['k']}/{arm['h']}", {"k": arm["k"], "h": arm["h"], "gaps": {}})
        if arm["name"].endswith("-auto"):
            cell["auto"] = _name(outer)
            cell["gaps"]["auto"] = arm["gap_vs_ddp"]
        else:
            fixed.add(outer)
        cell["gaps"][_name(outer)] = arm["gap_vs_ddp"]
    for cell in cells.values():
        cell["best"] = min(cell["gaps"], key=cell["gaps"].get)
    columns = _columns(fixed)
    worst = {}  # each rule over the cells that measured it
    for rule in columns:
        worst[rule] = max(cell["gaps"][rule] for cell in cells.values() if rule in cell["gaps"])
    return {"cells": list(cells.values()), "rules": columns, "worst_gap": worst}


def _columns(fixed: set[Setting]) -> list[str]:
    """The paper's setting, plain averaging, the others by lr, momentum and warm-up, and auto last."""
    first = [s for s in (PAPER, PLAIN) if s in fixed]
    return [_name(s) for s in (*first, *sorted(fixed - set(first)))] + ["auto"]


def _name(setting: Setting | None) -> str:
    if setting is None:
        return "–"
    lr, momentum, warmup = setting
    return f"{lr:g}/{momentum:g}" + (f" w{warmup}" if warmup else "")


def stem(quick: bool, study: str = "defaults", **_options: Any) -> str:
    """The name of the bench's JSON and PNG: convergence[-map][-quick] (``diloco.bench.run`` asks for it)."""
    return "convergence" + ("" if study == "defaults" else f"-{study}") + ("-quick" if quick else "")


# ---------------------------------------------------------------- the section


def workload_text(w: dict[str, Any]) -> str:
    """The workload (`Workload` as a dict) in words, for this bench's section and `compression`'s."""
    return (
        f"model {Path(w['model']).name} ({w['parameters'] / 1e6:.2f}M parameters), {Path(w['corpus']).name} (byte "
        f"tokenizer), seq {w['seq_length']}, B = {w['batch']} sequences per group, S = {w['steps']} inner steps per "
        f"group, AdamW lr {w['lr']:g} with {w['warmup_steps']} warm-up steps and cosine decay; eval loss over "
        f"{w['eval_batches']} held-out batches; seeds {', '.join(map(str, w['seeds']))}"
    )


def markdown(result: dict[str, Any]) -> str:
    lines = [
        *section_head(result),
        f"- study `{result['study']}`: {workload_text(result['workload'])}",
        "- equal tokens per k: single = 1 model at B for k·S steps; ddp = 1 model at k·B for S steps; diloco = k "
        "groups at B for S steps each; m1 = DiLoCo with one group at B for k·S steps. The groups run in threads of "
        "one process with an exact in-memory mean (what `--hv.compression none` computes), the trainer's own inner "
        "loop pieces and `DiLoCo` outer step; outer setting lr/momentum, `wN`: the outer lr rises over N outer "
        f"steps; `auto`: what the trainer picks with no outer flags. {result['workers']} arms at a time, one torch "
        "thread each (wall s follow that)",
        f"- vs DDP: against DDP at its best inner schedule, the DDP arm of the lowest mean loss at each k "
        f"({_refs(result)}); `-lrX-wuN`: an arm at inner lr X with N warm-up steps in place of the workload's",
        f"- 1-minute load average at start / end: {result['machine']['load_avg_1m']:.1f} / "
        f"{result['load_avg_1m_end']:.1f}",
    ]
    if "plot" in result:
        lines.append(f"- plot: ![eval loss]({result['plot']})")
    lines += ["", "| k | arm | H | outer | eval loss per seed | mean | vs DDP per seed | vs DDP | wall s |",
              "|---:|---|---:|---|---|---:|---|---:|---:|"]  # fmt: skip
    for a in result["arms"]:
        losses = ", ".join(f"{loss:.4f}" for loss in a["final_eval_loss"])
        gaps = ", ".join(f"{g * 100:+.1f}%" for g in a["gap_by_seed"])
        lines.append(
            f"| {a['k']} | {a['name']} | {a['h'] or '–'} | {_name(_setting(a))}{_moment(a)} | {losses} | "
            f"{a['mean_eval_loss']:.4f} | {gaps} | {a['gap_vs_ddp'] * 100:+.1f}% | {a['wall_s']:.0f} |"
        )
    if "target" in result:
        lines += ["", *_defaults_verdict(result)]
    elif "map" in result:
        lines += ["", *_map_tables(result["map"])]
    else:
        gaps = ", ".join(f"{name} {gap * 100:+.2f}%" for name, gap in result["vs_blocking"].items())
        lines += ["", f"Against blocking rounds of the whole model (auto), mean over the seeds: {gaps}."]
    return "\n".join(lines) + "\n"


def _refs(result: dict[str, Any]) -> str:
    """Which DDP arm every gap is against, per k."""
    return "; ".join(f"k = {k}: `{name}`" for k, name in result["ddp"].items())


def _defaults_verdict(result: dict[str, Any]) -> list[str]:
    tgt = result["target"]
    parts = []
    for k, v in tgt["by_k"].items():
        goal = "no target" if v["max_gap"] is None else f"target {v['max_gap'] * 100:g}%: " + (
            "met" if v["met"] else "missed"
        )
        parts.append(
            f"k = {k}: `{v['arm']}`, auto = {_name(tuple(v['setting']))}, {v['gap_vs_ddp'] * 100:+.1f}% (worst "
            f"seed {v['worst_gap'] * 100:+.1f}%; {goal})"
        )
    lines = [f"No outer flags (auto) at H = {tgt['h']} at its best inner schedule, against DDP at its best, at "
             "equal tokens: " + "; ".join(parts) + "."]  # fmt: skip
    if result.get("m1"):
        m = "; ".join(
            f"k = {k}: {v['vs_ddp'] * 100:+.1f}% vs DDP, {v['vs_single'] * 100:+.1f}% vs single"
            for k, v in result["m1"].items()
        )
        lines.append(f"M = 1 (one group, outer 0.7/0.9, at k·S steps): {m}.")
    return lines


def _map_tables(grid_: dict[str, Any]) -> list[str]:
    columns = grid_["rules"]
    lines = ["Gap to DDP at equal tokens, the mean over the seeds the cell ran (bold: the best of the cell; auto: "
             "what the trainer picks with no outer flags, its setting in brackets; –: not run there):", "",
             "| k | H | " + " | ".join(columns) + " |", "|---:|---:|" + "---:|" * len(columns)]  # fmt: skip
    for cell in grid_["cells"]:
        best = cell["gaps"][cell["best"]]
        row = []
        for rule in columns:
            gap = cell["gaps"].get(rule)
            text = "–" if gap is None else f"{gap * 100:+.1f}%"
            row.append(f"**{text}**" if gap == best else text)
        row[-1] += f" ({cell['auto']})"
        lines.append(f"| {cell['k']} | {cell['h']} | " + " | ".join(row) + " |")
    worst = ", ".join(
        f"{rule} {gap * 100:+.1f}% ({sum(rule in c['gaps'] for c in grid_['cells'])} cells)"
        for rule, gap in grid_["worst_gap"].items()
    )
    return [*lines, "", f"Worst gap over every (k, H) of the map, per rule (over the cells that ran it): {worst}."]


# ---------------------------------------------------------------- the plot


def plot(result: dict[str, Any], out: Path) -> Path:
    """defaults: eval loss against tokens per k (DDP, auto, the paper's setting, single and M = 1); map: the gap
    to DDP against H per k, one line per outer setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({a["k"] for a in result["arms"]})
    fig, axes = plt.subplots(1, len(ks), figsize=(5.5 * len(ks), 4.5), squeeze=False)
    for ax, k in zip(axes[0], ks):
        if "map" in result:
            _map_panel(ax, [c for c in result["map"]["cells"] if c["k"] == k], result["map"]["rules"])
        else:
            _curve_panel(ax, [a for a in result["arms"] if a["k"] == k and not a["trial"]])
        ax.set_title(f"k = {k}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"convergence, study {result['study']}, {result['date']}")
    fig.tight_layout()
    path = out / f"{stem(result['quick'], result['study'])}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _curve_panel(ax: Any, arms: list[dict[str, Any]]) -> None:
    for arm in arms:
        if arm["name"].startswith("diloco-") and not (is_auto(arm) or arm["name"].endswith("0.7/0.9")):
            continue  # plain averaging is in the table
        tokens, losses = zip(*arm["curve"])
        style = "--" if arm["outer"] is None else "-"
        ax.plot([t / 1e6 for t in tokens], losses, style, marker=".", label=f"{arm['name']} ({_name(_setting(arm))})")
    ax.set(xlabel="training tokens (millions, all groups)", ylabel="held-out loss")
    bottom, top = ax.get_ylim()
    if bottom < 3.5:  # zoom in below the first, steep evaluations (a short run may never get there)
        ax.set_ylim(top=min(top, 3.5))


def _map_panel(ax: Any, cells: list[dict[str, Any]], rules: list[str]) -> None:
    for rule in rules:
        points = sorted((c["h"], c["gaps"][rule] * 100) for c in cells if rule in c["gaps"])
        if not points:  # a setting run at other k only
            continue
        ax.plot(*zip(*points), marker="o", label=rule)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(xscale="log", xlabel="H (inner steps per outer step)", ylabel="final eval loss vs DDP (%)")

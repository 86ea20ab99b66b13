"""`diloco bench compression`: what each `--hv.compression` wire format costs in held-out loss at equal tokens, and
how many bytes it puts on the wire.

The convergence bench's workload (real text, byte tokenizer, its ~1M-parameter llama) at k = 2 worker groups,
H = 25, outer lr 1.0 and momentum 0 (fixed: only the wire format differs between arms), for two seeds; arms: DDP,
and DiLoCo whose in-memory mean goes through each wire format part by part, every contribution and the average, as
over the wire (`diloco.outer.memory`). Bytes per value are the encoded bytes of every contribution ÷ its values,
measured.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.bench import section_head
from diloco.bench.convergence import ArmSpec, load_corpus, run_arm, workload
from diloco.bench.convergence_report import workload_text
from diloco.bench.models import model_folder
from diloco.model import load_model

__all__ = ["markdown", "measure"]

COMPRESSIONS = ("none", "fp16", "int8", "int4")
K = 2
OUTER = (1.0, 0.0)


def arm_specs(h: int, batch: int, steps: int) -> list[ArmSpec]:
    specs = [ArmSpec("ddp", K, 1, K * batch, steps)]
    return specs + [ArmSpec(f"diloco-{c}", K, K, batch, steps, h, OUTER, compression=c) for c in COMPRESSIONS]


def measure(quick: bool, work_dir: Path, info: dict[str, Any], data: Path) -> dict[str, Any]:
    log = logging.getLogger("diloco")
    w = workload(quick)
    h = 5 if quick else 25
    seeds = (0,) if quick else (0, 1)
    w = replace(w, model=model_folder(w.model, work_dir / "models"), seeds=seeds)
    corpus = load_corpus(w, data)
    threads_before, level = torch.get_num_threads(), log.level
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        for seed in seeds:
            for spec in arm_specs(h, w.batch, w.steps):
                torch.set_num_threads(max(1, info["usable_cores"] // spec.groups))
                log.setLevel(logging.ERROR)  # a line per outer step would bury the results
                try:
                    run = run_arm(spec, replace(w, seed=seed), corpus)
                finally:
                    log.setLevel(level)
                runs.setdefault(spec.name, []).append(run | {"seed": seed})
                log.info("bench arm %s seed %d: eval loss %.4f (%.0f s)", spec.name, seed, run["final_eval_loss"],
                         run["wall_s"])  # fmt: skip
    finally:
        torch.set_num_threads(threads_before)
    params = sum(p.numel() for p in load_model(w.model, 0).parameters())
    arms = [summarize(name, per_seed, params) for name, per_seed in runs.items()]
    ddp, exact = (next(a for a in arms if a["name"] == n) for n in ("ddp", "diloco-none"))
    for arm in arms:
        arm["gap_vs_ddp"] = arm["mean_eval_loss"] / ddp["mean_eval_loss"] - 1
        arm["gap_vs_none"] = arm["mean_eval_loss"] / exact["mean_eval_loss"] - 1
    return {"workload": asdict(w) | {"model": str(w.model), "corpus": str(data.resolve()), "parameters": params},
            "k": K, "h": h,
            "outer": list(OUTER), "seeds": list(seeds), "arms": arms}  # fmt: skip


def summarize(name: str, per_seed: list[dict[str, Any]], params: int) -> dict[str, Any]:
    losses = [run["final_eval_loss"] for run in per_seed]
    first = per_seed[0]
    # pseudo-gradients sent over all rounds (the last inner step always ends one), groups and seeds
    sent = sum(math.ceil(run["steps"] / run["h"]) * run["groups"] for run in per_seed) if first["h"] else 0
    wire = sum(run["wire_bytes"] for run in per_seed)
    return {
        "name": name,
        "compression": first["compression"] or "",
        "final_eval_loss": losses,
        "mean_eval_loss": float(np.mean(losses)),
        "spread": float(max(losses) - min(losses)),
        "groups_identical": all(run["groups_identical"] for run in per_seed),
        "wire_bytes": wire,
        "bytes_per_value": wire / (sent * params) if sent else None,
        "wall_s": sum(run["wall_s"] for run in per_seed),
        "runs": per_seed,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        *section_head(result),
        f"- the convergence bench's workload: {workload_text(result['workload'])}; k = {result['k']} groups, H = "
        f"{result['h']}, outer lr / momentum {result['outer'][0]:g} / {result['outer'][1]:g}; DDP at k·B for S "
        "steps (equal tokens)",
        "- DiLoCo's in-memory mean goes through the wire format part by part, every contribution and the average, "
        "as a round does over the wire (a real reducer's own part skips the codec); bytes per value: the encoded "
        "bytes of every contribution ÷ its values, counted",
        f"- 1-minute load average at start / end: {result['machine']['load_avg_1m']:.1f} / "
        f"{result['load_avg_1m_end']:.1f}",
        "",
        "| arm | bytes per value | final eval loss per seed | mean | spread | vs none | vs DDP | groups identical |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for a in result["arms"]:
        per_value = f"{a['bytes_per_value']:.3f}" if a["bytes_per_value"] else "–"
        losses = ", ".join(f"{loss:.4f}" for loss in a["final_eval_loss"])
        lines.append(
            f"| {a['name']} | {per_value} | {losses} | {a['mean_eval_loss']:.4f} | {a['spread']:.4f} | "
            f"{a['gap_vs_none'] * 100:+.2f}% | {a['gap_vs_ddp'] * 100:+.2f}% | {a['groups_identical']} |"
        )
    return "\n".join(lines) + "\n"

"""`diloco bench compression`: what each `--hv.compression` wire format costs in held-out loss at equal tokens, and
how many bytes it puts on the wire.

The convergence bench's workload (real text, byte tokenizer, its ~1M-parameter llama) at k = 2 worker groups,
H = 25, outer lr 1.0 and momentum 0 (fixed: only the wire format differs between arms), for three seeds; arms: DDP,
and DiLoCo whose in-memory mean goes through each wire format part by part, every contribution and the average, as
over the wire (`diloco.outer.memory`). Sparse arms (SparseLoCo: `diloco.swarm.rounds.sparse`) at densities 1/16 to
1/256 with 2 and 4 bits, under SparseLoCo's rule (error feedback decayed by 0.95 in place of momentum) and one under
the dense arms' outer step with the error kept whole (``nesterov``, here at momentum 0), and one at a higher outer
lr; then at k = 4 for the dense arm and one sparse one. Bytes per value are the encoded bytes of every
contribution ÷ its values, measured; a sparse round's reducer relays every group's contribution to every group, so
a group receives k contributions (the relay's bytes, measured in the format table). The format table measures the
sparse format's bytes on the parameter shapes of larger models (Gaussian values: the positions of the k largest are
then uniform), where rows are wider than this model's.
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

__all__ = ["markdown", "measure", "plot"]

DENSE = ("none",)  # (fp16, int8 and int4 against none: their sections in git history, within 0.6%)
SPARSE = ((1 / 16, 2), (1 / 64, 2), (1 / 256, 2), (1 / 16, 4), (1 / 64, 4), (1 / 256, 4))
K, WIDE_K = 2, 4
OUTER = (1.0, 0.0)
TUNED_LR = 2.0  # a sparse arm's higher outer lr: a round applies only what it selected


def sparse_arm(k: int, batch: int, steps: int, h: int, density: float, bits: int, rule: str = "sparseloco",
               lr: float = OUTER[0]) -> ArmSpec:  # fmt: skip
    name = f"sparse-1/{round(1 / density)}-{bits}b" + ("" if rule == "sparseloco" else f"-{rule}")
    name += "" if lr == OUTER[0] else f"-lr{lr:g}"
    return ArmSpec(name, k, k, batch, steps, h, (lr, OUTER[1]), compression=f"sparse:{density!r}:{bits}:{rule}")


def arm_specs(k: int, h: int, batch: int, steps: int, wide: bool = False, quick: bool = False) -> list[ArmSpec]:
    """The arms at galaxy size `k`; `wide`: the k = 4 subset (DDP, none, one sparse); `quick`: two sparse arms."""
    specs = [ArmSpec("ddp", k, 1, k * batch, steps)]
    specs += [ArmSpec(f"diloco-{c}", k, k, batch, steps, h, OUTER, compression=c) for c in DENSE]
    chosen = ((1 / 16, 2),) if wide else ((1 / 16, 2), (1 / 64, 4)) if quick else SPARSE
    specs += [sparse_arm(k, batch, steps, h, d, b) for d, b in chosen]
    if not wide and not quick:
        specs += [sparse_arm(k, batch, steps, h, 1 / 64, 2, "nesterov"), sparse_arm(k, batch, steps, h, 1 / 64, 2,
                                                                                   lr=TUNED_LR)]  # fmt: skip
    return specs


def measure(quick: bool, work_dir: Path, info: dict[str, Any], data: Path) -> dict[str, Any]:
    log = logging.getLogger("diloco")
    w = workload(quick)
    h = 5 if quick else 25
    seeds = (0,) if quick else (0, 1, 2)
    w = replace(w, model=model_folder(w.model, work_dir / "models"), seeds=seeds)
    corpus = load_corpus(w, data)
    threads_before, level = torch.get_num_threads(), log.level
    settings = [(K, arm_specs(K, h, w.batch, w.steps, quick=quick))] + ([] if quick else [
        (WIDE_K, arm_specs(WIDE_K, h, w.batch, w.steps, wide=True))])  # fmt: skip
    tables = []
    try:
        for k, specs in settings:
            runs: dict[str, list[dict[str, Any]]] = {}
            for seed in seeds:
                for spec in specs:
                    torch.set_num_threads(max(1, info["usable_cores"] // spec.groups))
                    log.setLevel(logging.ERROR)  # a line per outer step would bury the results
                    try:
                        run = run_arm(spec, replace(w, seed=seed), corpus)
                    finally:
                        log.setLevel(level)
                    runs.setdefault(spec.name, []).append(run | {"seed": seed})
                    log.info("bench arm k=%d %s seed %d: eval loss %.4f (%.0f s)", k, spec.name, seed,
                             run["final_eval_loss"], run["wall_s"])  # fmt: skip
            tables.append({"k": k, "arms": compare([summarize(name, per_seed, parameters(w.model))
                                                    for name, per_seed in runs.items()])})  # fmt: skip
    finally:
        torch.set_num_threads(threads_before)
    params = parameters(w.model)
    return {"workload": asdict(w) | {"model": str(w.model), "corpus": str(data.resolve()), "parameters": params},
            "k": K, "h": h, "outer": list(OUTER), "seeds": list(seeds), "tables": tables,
            "arms": tables[0]["arms"], "formats": format_sizes(w.model, quick)}  # fmt: skip


def parameters(model: Path) -> int:
    return sum(p.numel() for p in load_model(model, 0).parameters())


def compare(arms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ddp, exact = (next(a for a in arms if a["name"] == n) for n in ("ddp", "diloco-none"))
    for arm in arms:
        arm["gap_vs_ddp"] = arm["mean_eval_loss"] / ddp["mean_eval_loss"] - 1
        arm["gap_vs_none"] = arm["mean_eval_loss"] / exact["mean_eval_loss"] - 1
    return arms


def format_sizes(model: Path, quick: bool) -> list[dict[str, Any]]:
    """Bytes of the sparse format per parameter on each model's shapes: a contribution, and the relay of 2 and 4
    groups' contributions (what a group receives), against float32's 4 + 4 per round."""
    from diloco.swarm.rounds.chunks import Chunks
    from diloco.swarm.rounds.sparse import SparseCodec

    models = {"bench model": [tuple(p.shape) for p in load_model(model, 0).parameters()]}
    if not quick:
        models |= {"gpt2-124M": gpt2_shapes(), "llama-7B, 2 layers": llama_layers(2)}
    rows = []
    for name, shapes in models.items():
        n = sum(math.prod(s) for s in shapes)
        chunks = Chunks(shapes)
        values = torch.randn(n, generator=torch.Generator().manual_seed(0))
        for density, bits in SPARSE:
            codec = SparseCodec(chunks, density, bits)
            sizes = dict.fromkeys(("total", "positions", "plain_positions", "scales", "values", "dense", "selected"), 0)
            messages = []
            for lo, hi in chunks.runs(0, n, 2**18):
                part = codec.sizes(values[lo:hi], lo)
                sizes = {key: sizes[key] + part[key] for key in sizes}
                messages.append(part["total"])
            up = sizes["total"] / n
            relay = {g: sum(4 + g * (12 + m) for m in messages) / n for g in (2, 4)}
            rows.append({"model": name, "parameters": n, "density": density, "bits": bits, "up": up,
                         "down_2": relay[2], "down_4": relay[4], "fewer_2": 8 / (up + relay[2]),
                         "fewer_4": 8 / (up + relay[4]), "positions_bits": 8 * sizes["positions"] / sizes["selected"],
                         "plain_bits": 8 * sizes["plain_positions"] / sizes["selected"],
                         "sections": sizes})  # fmt: skip
    return rows


def gpt2_shapes() -> list[tuple[int, ...]]:
    """GPT-2 124M's parameter shapes (Conv1D weights are (in, out))."""
    d, vocab, layers = 768, 50257, 12
    layer = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (1024, d), *layer * layers, (d,), (d,)]


def llama_layers(count: int) -> list[tuple[int, ...]]:
    """`count` decoder layers of Llama-2-7B."""
    d, ffn = 4096, 11008
    return [(d, d), (d, d), (d, d), (d, d), (ffn, d), (ffn, d), (d, ffn), (d,), (d,)] * count


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
        f"- the convergence bench's workload: {workload_text(result['workload'])}; H = {result['h']}, outer lr / "
        f"momentum {result['outer'][0]:g} / {result['outer'][1]:g} unless the arm says; DDP at k·B for S steps "
        "(equal tokens)",
        "- DiLoCo's in-memory mean goes through the wire format part by part, every contribution and, for dense "
        "formats, the average, as a round does over the wire; a sparse round's reducer relays the contributions "
        "and every group averages them alike. Bytes per value: the encoded bytes of every contribution ÷ its "
        "values, counted; x fewer: float32's 8 bytes per value and round (its contribution out, the average in) ÷ "
        "(a contribution out + k of them in)",
        "- sparse arms: SparseLoCo's rule (error feedback decayed by 0.95, no momentum) unless named nesterov (the "
        "error kept whole, the dense arms' outer step); `-lr2`: outer lr 2",
        f"- 1-minute load average at start / end: {result['machine']['load_avg_1m']:.1f} / "
        f"{result['load_avg_1m_end']:.1f}",
    ]
    for table in result.get("tables", [{"k": result["k"], "arms": result["arms"]}]):
        k = table["k"]
        lines += ["", f"k = {k} groups:", "",
                  "| arm | bytes per value | x fewer than float32 | final eval loss per seed | mean | spread | vs none "
                  "| vs DDP | groups identical |",
                  "|---|---:|---:|---|---:|---:|---:|---:|---|"]  # fmt: skip
        for a in table["arms"]:
            per_value, fewer_value = a["bytes_per_value"], fewer_than_float32(a, k)
            fewer = "–" if fewer_value is None else f"{fewer_value:.0f}" if a["compression"].startswith(
                "sparse") else f"{fewer_value:.1f}"
            losses = ", ".join(f"{loss:.4f}" for loss in a["final_eval_loss"])
            lines.append(
                f"| {a['name']} | {f'{per_value:.4f}' if per_value else '–'} | {fewer} | {losses} | "
                f"{a['mean_eval_loss']:.4f} | {a['spread']:.4f} | {a['gap_vs_none'] * 100:+.2f}% | "
                f"{a['gap_vs_ddp'] * 100:+.2f}% | {a['groups_identical']} |"
            )
    formats = result.get("formats", [])
    if formats:
        lines += ["", "The sparse format's bytes per parameter on other models' shapes (one contribution; the relay a "
                  "group receives with 2 and 4 groups; x fewer than float32's 8 per round), and the bits a selected "
                  "value's position takes, Golomb-Rice coded against plain offsets:", "",
                  "| model | parameters | density | bits | up | in, k = 2 | x fewer, k = 2 | in, k = 4 "
                  "| x fewer, k = 4 | position bits | plain offset bits |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for f in formats:
            lines.append(f"| {f['model']} | {f['parameters']:,} | 1/{round(1 / f['density'])} | {f['bits']} | "
                         f"{f['up']:.4f} | {f['down_2']:.4f} | {f['fewer_2']:.0f} | {f['down_4']:.4f} | "
                         f"{f['fewer_4']:.0f} | {f['positions_bits']:.2f} | {f['plain_bits']:.2f} |")  # fmt: skip
    if "plot" in result:
        lines += ["", f"![held-out loss against bytes per round]({result['plot']})"]
    return "\n".join(lines) + "\n"


def fewer_than_float32(arm: dict[str, Any], k: int) -> float | None:
    """How many times fewer bytes than float32 a round of `arm` moves per group (None: DDP)."""
    per_value = arm["bytes_per_value"]
    if not per_value:
        return None
    return 8 / (per_value * (1 + k)) if arm["compression"].startswith("sparse") else 4 / per_value


def plot(result: dict[str, Any], out: Path) -> Path:
    """Held-out loss (mean over seeds, the seeds' range as a bar) against how many times fewer bytes than float32 a
    round moves, one point per arm, one panel per k; DDP as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = result.get("tables", [{"k": result["k"], "arms": result["arms"]}])
    fig, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 4), squeeze=False)
    for ax, table in zip(axes[0], tables):
        for arm in table["arms"]:
            fewer = fewer_than_float32(arm, table["k"])
            if fewer is None:
                ax.axhline(arm["mean_eval_loss"], color="grey", linestyle="--", label="ddp")
                continue
            losses = arm["final_eval_loss"]
            low, high = arm["mean_eval_loss"] - min(losses), max(losses) - arm["mean_eval_loss"]
            ax.errorbar([fewer], [arm["mean_eval_loss"]], yerr=[[low], [high]], marker="o", capsize=3,
                        label=arm["name"])  # fmt: skip
        ax.set(xscale="log", title=f"k = {table['k']} groups", xlabel="x fewer bytes per round than float32",
               ylabel="held-out loss")  # fmt: skip
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / f"compression{'-quick' if result['quick'] else ''}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

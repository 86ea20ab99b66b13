"""`diloco bench convergence`: held-out loss at equal tokens, DiLoCo against data-parallel training.

Real text (the file `--data` names, e.g. tinyshakespeare; byte tokenizer), a ~1M-parameter llama, seq 128. For
k = 2 and 4 worker groups, every arm sees the same number of training tokens:

- `single`: one model at batch B for k·S steps;
- `ddp`: one model at batch k·B for S steps (the gradient of DDP over k ranks of batch B, summed in another
  order);
- `diloco-H…`: k groups at batch B for S steps each, an outer step every H, for every H and every outer
  (lr, momentum) setting;
- `m1`: DiLoCo with one group (M = 1) at batch B for k·S steps, H = 25, the paper's outer 0.7/0.9.

The groups of an arm run in threads of this process and average through the in-memory swarm
(`diloco.swarm.memory`): an exact mean, which is what the swarm computes with `--hv.compression none`
(bit-identical in every group). The inner loop (AdamW, warm-up + cosine, clipping, the trainer's constants and
data pipeline) and the outer step (`DiLoCo`, the trainer's class) are the product's own; only the transport is
left out, which `allreduce` and `wire` measure.
The eval loss is measured on held-out text at fixed token counts (DiLoCo: the groups' common model right
after an outer step) and at the end of every arm.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import get_cosine_schedule_with_warmup

from diloco.bench import BenchError, section_head
from diloco.bench.models import model_folder
from diloco.config import Config, FieldError
from diloco.data import BlockBatches, ByteTokenizer, Shard, pack, tokenize_corpus
from diloco.links import solo_group
from diloco.membership import DiLoCo
from diloco.model import load_model
from diloco.swarm.memory import MemorySwarm

# the trainer's inner-optimizer defaults (its flags), so the bench's arms train as `diloco train` does
ADAMW_BETAS = Config.model_fields["adam_betas"].default
WEIGHT_DECAY = Config.model_fields["weight_decay"].default
GRAD_CLIP = Config.model_fields["max_grad_norm"].default

MODEL = "llama-1m-bytes"  # in `bench.models`
TARGET_GAP = 0.02  # DiLoCo at H = 25 within 2% of DDP's eval loss
OUTER_SETTINGS = ((1.0, 0.0), (0.7, 0.5), (0.7, 0.9))  # (outer lr, outer momentum)


@dataclass(frozen=True)
class Workload:
    """What every arm trains. Tokens per group step = batch × seq_length."""

    model: str | Path  # a model folder, or the name of one of `bench.models` (written into the work dir)
    seq_length: int
    batch: int  # B: sequences per group per inner step
    steps: int  # S: inner steps per group (single and M = 1 take k·S)
    lr: float
    warmup_steps: int
    eval_batches: int  # held-out batches of `batch` sequences per evaluation
    evals: int  # evaluations along the way (besides the final one)
    ks: tuple[int, ...]
    hs: tuple[int, ...]
    outer: tuple[tuple[float, float], ...]
    m1_h: int
    seed: int = 0


def workload(quick: bool) -> Workload:
    if quick:  # a smoke run: every kind of arm, and an outer step at both H, in a few seconds of compute
        return Workload(MODEL, 32, 4, 10, 3e-3, 2, 2, 2, (2,), (5, 10), ((1.0, 0.0), (0.7, 0.9)), 5)
    return Workload(MODEL, 128, 8, 200, 3e-3, 20, 16, 4, (2, 4), (10, 25, 50, 100), OUTER_SETTINGS, 25)


@dataclass(frozen=True)
class ArmSpec:
    """One arm: `groups` models at batch `batch`, `steps` inner steps each; outer=None: no outer step."""

    name: str
    k: int  # the galaxy size this arm is compared at (equal tokens)
    groups: int
    batch: int
    steps: int
    h: int | None = None
    outer: tuple[float, float] | None = None
    compression: str | None = None  # the wire format the in-memory mean goes through (`bench compression`)


def arm_specs(w: Workload) -> list[ArmSpec]:
    specs = []
    for k in w.ks:
        specs += [ArmSpec("single", k, 1, w.batch, k * w.steps), ArmSpec("ddp", k, 1, k * w.batch, w.steps)]
        specs += [
            ArmSpec(f"diloco-H{h}-{lr:g}/{m:g}", k, k, w.batch, w.steps, h, (lr, m)) for h in w.hs for lr, m in w.outer
        ]
        specs.append(ArmSpec(f"m1-H{w.m1_h}-0.7/0.9", k, 1, w.batch, k * w.steps, w.m1_h, (0.7, 0.9)))
    return specs


# ---------------------------------------------------------------- one arm


@dataclass
class Corpus:
    train: np.ndarray  # (blocks, seq_length) token ids
    held_out: list[torch.Tensor]  # fixed eval batches


def load_corpus(w: Workload, data: Path) -> Corpus:
    """`data` as byte tokens, packed into training blocks and the held-out batches every arm is evaluated on."""
    try:
        tokens = tokenize_corpus(data, ByteTokenizer())
    except FieldError as e:  # the trainer's reader names the trainer's field (dataset); here it is --data
        raise e.spelled(lambda _field: "--data") from None
    train, held_out = pack(tokens, w.seq_length)
    batches = torch.from_numpy(held_out.astype(np.int64)).split(w.batch)
    if len(batches) < w.eval_batches:
        raise BenchError(f"{data}: {len(batches)} held-out batches, {w.eval_batches} needed")
    return Corpus(train, list(batches[: w.eval_batches]))


@torch.no_grad()
def eval_loss(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    model.eval()
    losses = [model(input_ids=b, labels=b, use_cache=False).loss.item() for b in batches]
    model.train()
    return float(np.mean(losses))


def run_arm(spec: ArmSpec, w: Workload, corpus: Corpus) -> dict[str, Any]:
    """Train one arm; returns its eval curve (tokens seen by all groups, loss) and final eval loss."""
    swarm = MemorySwarm(spec.groups, codec=None if spec.compression is None else _codec(spec.compression))
    models = [load_model(w.model, w.seed) for _ in range(spec.groups)]  # one initialisation for all groups
    tokens_per_step = spec.groups * spec.batch * w.seq_length
    every = max(spec.steps // w.evals, 1)
    curve: list[tuple[int, float]] = [(0, eval_loss(models[0], corpus.held_out))]
    lock = threading.Lock()

    def group(g: int) -> None:
        model = models[g]
        data = BlockBatches(corpus.train, Shard(g, spec.groups), spec.batch, w.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=w.lr, betas=ADAMW_BETAS, weight_decay=WEIGHT_DECAY)
        schedule = get_cosine_schedule_with_warmup(opt, w.warmup_steps, spec.steps)
        outer = None
        if spec.outer is not None:
            lr, momentum = spec.outer
            outer = DiLoCo([p.data for p in model.parameters()], swarm.member(f"g{g}"), solo_group(), world_rank=g,
                           local_steps=spec.h, outer_lr=lr, outer_momentum=momentum, final_step=spec.steps)  # fmt: skip
        for step in range(1, spec.steps + 1):
            batch = data.next_batch()
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            opt.step()
            schedule.step()
            opt.zero_grad(set_to_none=True)
            if not math.isfinite(loss.item()):
                raise BenchError(f"arm {spec.name}: loss {loss.item()} at step {step}")
            # an OuterReport after an outer step (the groups then hold one model), None between outer steps
            synced = outer is None or outer.after_inner_step(step) is not None
            if g == 0 and synced and step % every == 0 and step < spec.steps:
                with lock:
                    curve.append((step * tokens_per_step, eval_loss(model, corpus.held_out)))

    threads = [
        threading.Thread(target=swarm.guard(functools.partial(group, g)), name=f"{spec.name}-g{g}")
        for g in range(spec.groups)
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if swarm.failed:
        raise BenchError(f"arm {spec.name}: {swarm.failed[0]}")
    final = eval_loss(models[0], corpus.held_out)
    identical = all(torch.equal(p, q) for m in models[1:] for p, q in zip(models[0].parameters(), m.parameters()))
    curve.append((spec.steps * tokens_per_step, final))
    return asdict(spec) | {
        "wire_bytes": swarm.wire_bytes,
        "tokens": spec.steps * tokens_per_step,
        "final_eval_loss": final,
        "curve": curve,
        "groups_identical": identical,
        "wall_s": time.perf_counter() - started,
    }


def _codec(compression: str) -> object:
    from diloco.swarm.codecs import WIRE_FORMATS  # hivemind, for the codecs that wrap its quantizers

    return WIRE_FORMATS[compression].tcp


# ---------------------------------------------------------------- the bench


def measure(quick: bool, work_dir: Path, info: dict[str, Any], data: Path) -> dict[str, Any]:
    """Every arm, one after the other, on the text file `data`; gaps against DDP, the recommended outer setting
    and the target."""
    log = logging.getLogger("diloco")
    w = workload(quick)
    w = replace(w, model=model_folder(w.model, work_dir / "models"))
    corpus = load_corpus(w, data)
    threads_before, level = torch.get_num_threads(), log.level
    arms = []
    try:
        for spec in arm_specs(w):
            torch.set_num_threads(max(1, info["usable_cores"] // spec.groups))  # no more threads than cores
            log.setLevel(logging.ERROR)  # a line per outer step (and "alone" for M = 1) would bury the results
            try:
                arms.append(run_arm(spec, w, corpus))
            finally:
                log.setLevel(level)
            log.info("bench arm k=%d %s: eval loss %.4f (%.0f s)", spec.k, spec.name, arms[-1]["final_eval_loss"],
                     arms[-1]["wall_s"])  # fmt: skip
    finally:
        torch.set_num_threads(threads_before)
    for arm in arms:
        ddp = next(a for a in arms if a["k"] == arm["k"] and a["name"] == "ddp")
        arm["gap_vs_ddp"] = arm["final_eval_loss"] / ddp["final_eval_loss"] - 1
    params = sum(p.numel() for p in load_model(w.model, w.seed).parameters())
    return {
        "workload": asdict(w) | {"model": str(w.model), "corpus": str(data.resolve()), "parameters": params},
        "arms": arms,
        "recommendation": recommend(arms, small_h=sorted(w.hs)[:2]),
        "target": target(arms, h=25 if 25 in w.hs else sorted(w.hs)[0]),
    }


def _diloco(arms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [a for a in arms if a["groups"] > 1 and a["outer"] is not None]


def recommend(arms: list[dict[str, Any]], small_h: list[int]) -> dict[str, Any]:
    """The outer (lr, momentum) with the smallest mean gap to DDP over the small H and every k."""
    by_setting: dict[tuple[float, float], list[float]] = {}
    for arm in _diloco(arms):
        if arm["h"] in small_h:
            by_setting.setdefault(tuple(arm["outer"]), []).append(arm["gap_vs_ddp"])
    (lr, momentum), gaps = min(by_setting.items(), key=lambda item: float(np.mean(item[1])))
    return {"outer_lr": lr, "outer_momentum": momentum, "mean_gap_vs_ddp": float(np.mean(gaps)), "over_h": small_h}


def target(arms: list[dict[str, Any]], h: int) -> dict[str, Any]:
    """Per k, the best DiLoCo arm at H = h against the 2% target."""
    best = {}
    for k in sorted({a["k"] for a in arms}):
        candidates = [a for a in _diloco(arms) if a["k"] == k and a["h"] == h]
        arm = min(candidates, key=lambda a: a["gap_vs_ddp"])
        best[str(k)] = {"arm": arm["name"], "gap_vs_ddp": arm["gap_vs_ddp"], "met": arm["gap_vs_ddp"] <= TARGET_GAP}
    return {"h": h, "max_gap": TARGET_GAP, "best_by_k": best}


def plot(result: dict[str, Any], out: Path) -> Path:
    """Eval loss against tokens, one panel per k: single, DDP, M = 1 and DiLoCo at the recommended setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rec = result["recommendation"]
    setting = [rec["outer_lr"], rec["outer_momentum"]]
    ks = sorted({a["k"] for a in result["arms"]})
    fig, axes = plt.subplots(1, len(ks), figsize=(6 * len(ks), 4.5), squeeze=False)
    for ax, k in zip(axes[0], ks):
        for arm in result["arms"]:
            shown = arm["outer"] is None or arm["groups"] == 1 or list(arm["outer"]) == setting
            if arm["k"] == k and shown:
                tokens, losses = zip(*arm["curve"])
                style = "--" if arm["outer"] is None else "-"
                ax.plot([t / 1e6 for t in tokens], losses, style, marker=".", label=arm["name"])
        ax.set(title=f"k = {k}", xlabel="training tokens (millions, all groups)", ylabel="held-out loss")
        bottom, top = ax.get_ylim()
        if bottom < 3.5:  # zoom in below the first, steep evaluations (a short run may never get there)
            ax.set_ylim(top=min(top, 3.5))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"convergence {result['date']} (outer lr/momentum {setting[0]:g}/{setting[1]:g} for DiLoCo)")
    fig.tight_layout()
    path = out / f"convergence{'-quick' if result['quick'] else ''}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def markdown(result: dict[str, Any]) -> str:
    w, rec, tgt = result["workload"], result["recommendation"], result["target"]
    lines = [
        *section_head(result),
        f"- model {Path(w['model']).name} ({w['parameters'] / 1e6:.2f}M parameters), {Path(w['corpus']).name} "
        f"(byte tokenizer), seq {w['seq_length']}, B = {w['batch']} sequences per group, S = {w['steps']} inner "
        f"steps per group, AdamW lr {w['lr']:g} with {w['warmup_steps']} warm-up steps and cosine decay; eval "
        f"loss over {w['eval_batches']} held-out batches",
        "- equal tokens per k: single = 1 model at B for k·S steps; ddp = 1 model at k·B for S steps; diloco = k "
        "groups at B for S steps each; m1 = DiLoCo with one group at B for k·S steps. The groups run in threads of "
        "one process with an exact in-memory mean (what `--hv.compression none` computes) and the trainer's own "
        "inner loop pieces and `DiLoCo` outer step",
        f"- 1-minute load average at start / end: {result['machine']['load_avg_1m']:.1f} / "
        f"{result['load_avg_1m_end']:.1f}",
    ]
    if "plot" in result:
        lines.append(f"- plot: ![eval loss against tokens]({result['plot']})")
    lines += ["", "| k | arm | H | outer lr / momentum | tokens | final eval loss | vs DDP | wall s |",
              "|---:|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for a in result["arms"]:
        outer = f"{a['outer'][0]:g} / {a['outer'][1]:g}" if a["outer"] else "–"
        lines.append(
            f"| {a['k']} | {a['name']} | {a['h'] or '–'} | {outer} | {a['tokens']:,} | {a['final_eval_loss']:.4f} | "
            f"{a['gap_vs_ddp'] * 100:+.1f}% | {a['wall_s']:.0f} |"
        )
    verdicts = "; ".join(
        f"k={k}: {b['arm']} {b['gap_vs_ddp'] * 100:+.1f}% ({'meets' if b['met'] else 'misses'} it)"
        for k, b in tgt["best_by_k"].items()
    )
    lines += [
        "",
        f"Recommended outer setting for small H ({', '.join(map(str, rec['over_h']))}): **lr {rec['outer_lr']:g}, "
        f"momentum {rec['outer_momentum']:g}** (mean gap to DDP {rec['mean_gap_vs_ddp'] * 100:+.1f}%, measured "
        "above). Target: DiLoCo within "
        f"{tgt['max_gap'] * 100:g}% of DDP at H = {tgt['h']}: {verdicts}.",
    ]
    return "\n".join(lines) + "\n"

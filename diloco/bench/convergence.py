"""`diloco bench convergence`: held-out loss at equal tokens, DiLoCo against data-parallel training.

Real text (the file `--data` names, e.g. tinyshakespeare; byte tokenizer) and a small llama. Every arm at one
galaxy size k sees the same number of training tokens:

- `single`: one model at batch B for k·S steps;
- `ddp`: one model at batch k·B for S steps (the gradient of DDP over k ranks of batch B, summed in another
  order);
- `diloco-…`: k groups at batch B for S steps each, an outer step every H; `auto` is the outer setting the
  trainer picks with no outer flags (`diloco.config.auto_outer`), the others a fixed (lr, momentum, warm-up);
- `m1`: DiLoCo with one group (M = 1) at batch B for k·S steps;
- `ddp-lrX-wuN`, `diloco-H25-auto-lrX-wuN` (`defaults`): DDP and auto at another inner schedule, lr X with N
  warm-up steps. Every gap is against the best DDP arm of its k (DDP tuned, not at the groups' schedule), and the
  verdict on the defaults takes auto at its best schedule;
- at k = 4 (`defaults` only), trials of what else might close the gap to DDP: the inner lr, the inner warm-up,
  a smaller batch for more steps (against a DDP of that batch too).

Four studies (`--study`): `defaults` (the ~1M-parameter model, seq 128, S = 200, H = 25, k = 2, 4 and 8, three
seeds for the arms that decide the defaults), `map` (a 0.14M-parameter model, seq 64, S = 2000, so that H = 500
still makes 4 outer steps; H 10, 25, 50, 100, 250 and 500 at k = 2, 4 and 8; seeds 0 and 1, k = 8 on seed 0
only) and `streaming` (the defaults' workload at k = 2, H = 20: blocking rounds against two fragments, strided and
contiguous, blocking and overlapped; the quality side of `bench wan`, whose rounds cross a real network) and
`late` (the defaults' workload at k = 2 and 4: groups that come late to rounds keep their inner steps or drop them,
against no lateness; its arms, loop and figures are `diloco.bench.late`'s).

The groups of an arm run in threads of one process and average through the in-memory swarm
(`diloco.outer.memory`): an exact mean, which is what the swarm computes with `--hv.compression none`
(bit-identical in every group). The inner loop (AdamW, warm-up + cosine, clipping, the trainer's constants and
data pipeline) and the outer step (`DiLoCo`, the trainer's class) are the product's own; only the transport is
left out, which `allreduce` and `wire` measure. Arms run in parallel, one process per usable core with one torch
thread each: the losses do not depend on it, the wall times do.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.bench import BenchError
from diloco.bench.attacks import Attacker
from diloco.bench.convergence_report import (
    PAPER,
    PLAIN,
    Setting,
    markdown,
    plot,
    stem,
    summarize,
)
from diloco.bench.models import model_folder
from diloco.config import Config
from diloco.data import BlockBatches, ByteTokenizer, Shard, pack, tokenize_corpus
from diloco.errors import FieldError
from diloco.galaxy_moment import GalaxyAdamW, Halves, clip_factor
from diloco.model import load_model, parameter_layers
from diloco.outer.auto import auto_inner_moment, auto_outer
from diloco.outer.diloco import DiLoCo
from diloco.outer.fragments import fragment_params, local_runs
from diloco.outer.links import solo_group
from diloco.outer.memory import MemorySwarm
from diloco.schedule import cosine_with_warmup

__all__ = ["ArmSpec", "Workload", "load_corpus", "markdown", "measure", "plot", "run_arm", "stem"]

# studies with a module of their own, which builds on this one (``diloco.bench.run`` picks it)
STUDY_MODULES = {"late": "diloco.bench.late"}

# the trainer's inner-optimizer defaults (its flags), so the bench's arms train as `diloco train` does
ADAMW_BETAS = Config.model_fields["adam_betas"].default
WEIGHT_DECAY = Config.model_fields["weight_decay"].default
GRAD_CLIP = Config.model_fields["max_grad_norm"].default
# an arm's inner step is one micro-batch of its batch, as a trainer's whose --per-device-train-batch-size is its
# --total-batch-size: what `auto` picks the inner moment by
MICRO_BATCHES = 1


@dataclass(frozen=True)
class Workload:
    """What every arm of a study trains. Tokens per group step = batch × seq_length."""

    model: str | Path  # a model folder, or the name of one of `bench.models` (written into the work dir)
    seq_length: int
    batch: int  # B: sequences per group per inner step
    steps: int  # S: inner steps per group (single and M = 1 take k·S)
    lr: float
    warmup_steps: int
    eval_batches: int  # held-out batches of `batch` sequences per evaluation
    evals: int  # evaluations along the way (besides the final one)
    seeds: tuple[int, ...] = (0,)
    seed: int = 0  # the seed of `run_arm` when an arm names none (`bench compression`)
    # inner schedules (lr, warm-up steps) besides (`lr`, `warmup_steps`) that DDP and DiLoCo with no outer flags
    # also train with: every gap is against the DDP arm of the lowest mean loss at its k (DDP tuned), and the
    # verdict takes auto's best schedule, so that neither side is judged at a schedule that suits only the other
    schedules: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True)
class ArmSpec:
    """One arm: `groups` models at batch `batch`, `steps` inner steps each; outer=None: no outer step."""

    name: str
    k: int  # the galaxy size this arm is compared at (equal tokens)
    groups: int
    batch: int
    steps: int
    h: int | None = None
    outer: tuple[float, float] | None = None  # (lr, Nesterov momentum)
    compression: str | None = None  # the wire format the in-memory mean goes through (`bench compression`)
    outer_warmup: int = 0  # outer steps over which the outer lr rises to its value
    seed: int | None = None  # None: the workload's
    lr: float | None = None  # the inner lr; None: the workload's
    warmup_steps: int | None = None  # the inner warm-up; None: the workload's
    trial: str = ""  # what a trial arm changes, for the table
    fragments: int = 1  # --hv.fragments (`streaming` study)
    layout: str = "strided"  # --hv.fragment-layout
    overlap: int = 0  # --hv.overlap-steps
    mix: float = 0.5  # --hv.overlap-mix
    aggregation: str = "mean"  # --hv.aggregation (`bench poison`)
    attack: str = ""  # the last group forges its pseudo-gradients (`bench.attacks`); its data is group 0's
    inner_moment: str = "group"  # --hv.inner-moment: galaxy divides by the second moment of all groups' batches

    @property
    def setting(self) -> Setting | None:
        return None if self.outer is None else (*self.outer, self.outer_warmup)

    def cost(self) -> int:
        """Sequences trained, to start the longest arms first."""
        return self.groups * self.batch * self.steps


def workload(quick: bool, study: str = "defaults") -> Workload:
    if study == "map":
        if quick:
            return Workload("llama-0.1m-bytes", 32, 4, 20, 3e-3, 2, 2, 2)
        return Workload("llama-0.1m-bytes", 64, 4, 2000, 3e-3, 100, 16, 8, seeds=(0, 1))
    if quick:  # a smoke run: every kind of arm, and an outer step at both H, in a few seconds of compute
        return Workload("llama-1m-bytes", 32, 4, 10, 3e-3, 2, 2, 2, schedules=((2e-3, 5),))
    # 3e-3 with 150 warm-up steps: DDP's best of lr 2e-3 to 4e-3 with 20 to 190 warm-up steps at k = 4, and
    # DiLoCo's best of the warm-ups tried (docs/benchmarks.md, 2026-11-26 19:10-19:55 UTC)
    return Workload("llama-1m-bytes", 128, 8, 200, 3e-3, 20, 16, 4, seeds=(0, 1, 2), schedules=((3e-3, 150),))


def setting_name(setting: Setting) -> str:
    lr, momentum, warmup = setting
    return f"{lr:g}/{momentum:g}" + (f"w{warmup}" if warmup else "")


def diloco_arm(k: int, w: Workload, h: int, setting: Setting, seed: int, auto: bool = False) -> ArmSpec:
    """DiLoCo at galaxy size k; `auto`: what the trainer picks with no outer flags, the inner moment too."""
    name = f"diloco-H{h}-{'auto' if auto else setting_name(setting)}"
    moment = auto_inner_moment(h, k, MICRO_BATCHES) if auto else "group"
    return ArmSpec(name, k, k, w.batch, w.steps, h, setting[:2], outer_warmup=setting[2], seed=seed,
                   inner_moment=moment)  # fmt: skip


def baselines(k: int, w: Workload, seed: int) -> list[ArmSpec]:
    """`single` and `ddp` at galaxy size k."""
    return [ArmSpec("single", k, 1, w.batch, k * w.steps, seed=seed),
            ArmSpec("ddp", k, 1, k * w.batch, w.steps, seed=seed)]  # fmt: skip


def scheduled(arm: ArmSpec, schedule: tuple[float, int]) -> ArmSpec:
    """`arm` at another inner schedule (lr, warm-up steps), named after it (`…-lr…-wu…`)."""
    lr, warmup = schedule
    return replace(arm, name=f"{arm.name}-lr{lr:g}-wu{warmup}", lr=lr, warmup_steps=warmup)


def auto_arm(k: int, w: Workload, h: int, seed: int, schedule: tuple[float, int] | None = None) -> ArmSpec:
    """DiLoCo with no outer flags at the workload's inner schedule or at `schedule`: the outer setting follows the
    inner warm-up, as the trainer's does."""
    warmup = w.warmup_steps if schedule is None else schedule[1]
    arm = diloco_arm(k, w, h, auto_outer(h, k, warmup, w.steps), seed, auto=True)
    return arm if schedule is None else scheduled(arm, schedule)


def defaults_specs(w: Workload, quick: bool) -> list[ArmSpec]:
    """Per k and seed: DDP and DiLoCo with no outer flags (auto) at every inner schedule, auto with the other
    inner moment, plain averaging and the paper's setting at H = 25 (k = 8: the first seed only); once (the first
    seed): single and M = 1 at k = 2 and 4, and at k = 4 the trials (the last two: a smaller batch for more
    steps, DiLoCo and its DDP)."""
    h, ks = (5, (2,)) if quick else (25, (2, 4, 8))
    specs = []
    for seed in w.seeds:
        for k in ks if seed == w.seeds[0] else ks[:2]:  # k = 8 once: its DDP arm alone is the longest of all
            ddp, auto = baselines(k, w, seed)[1], auto_arm(k, w, h, seed)
            specs += [ddp, auto]
            specs += [a for s in w.schedules for a in (scheduled(ddp, s), auto_arm(k, w, h, seed, s))]
            other = "group" if auto.inner_moment == "galaxy" else "galaxy"  # auto with the other moment too
            specs.append(replace(auto, name=f"{auto.name}+{other}-moment", inner_moment=other))
            specs += [diloco_arm(k, w, h, s, seed) for s in (PLAIN, PAPER) if s != auto.setting]
    first = w.seeds[0]
    for k in ks[:2]:
        specs.append(baselines(k, w, first)[0])
        specs.append(replace(diloco_arm(k, w, h, PAPER, first), name=f"m1-H{h}-0.7/0.9", groups=1, steps=k * w.steps))
    k = ks[-1] if quick else 4
    auto = auto_outer(h, k, w.warmup_steps, w.steps)
    warmup = auto.warmup or 3
    plain = diloco_arm(k, w, h, PLAIN, first)
    trials = [  # each one change from plain averaging (1/0), but the last two outer ones
        (diloco_arm(k, w, h, (auto.lr, 0.0, 0), first), "outer lr scaled with k, no warm-up"),
        (diloco_arm(k, w, h, (1.0, 0.0, warmup), first), "outer-lr warm-up alone"),
        (replace(plain, warmup_steps=3 * w.warmup_steps), "inner warm-up ×3"),
        (replace(plain, lr=2 * w.lr), "inner lr ×2"),
        (replace(plain, lr=w.lr / 2), "inner lr ÷2"),
        (replace(plain, batch=w.batch // 2, steps=2 * w.steps, h=2 * h), "inner batch B/2 for 2·S steps, H ×2"),
        (diloco_arm(k, w, h, (auto.lr, 0.3, warmup), first), "auto + outer momentum 0.3"),
        (diloco_arm(k, w, h, (1.7, 0.0, warmup), first), "a larger outer lr, 1.7, with the warm-up"),
        (replace(diloco_arm(k, w, h, auto_outer(h, k, w.warmup_steps, 2 * w.steps), first), batch=w.batch // 2,
                 steps=2 * w.steps), "auto, inner batch B/2 for 2·S steps"),
        (replace(baselines(k, w, first)[1], batch=k * w.batch // 2, steps=2 * w.steps),
         "DDP at batch k·B/2 for 2·S steps, the fair baseline of the trial above"),
    ]
    for spec, what in trials:
        label = "ddp" if spec.setting is None else f"H{spec.h}-{setting_name(spec.setting)}"
        specs.append(replace(spec, name=f"trial-{label} ({what})", trial=what))
    return specs


# the map's (k, H) cells: six H at k = 2, 4 and 8 (S = 2000: 4 outer steps at H = 500), and besides the paper's
# setting, plain averaging and auto, two more outer settings, between and beyond them, at k = 2 and 4 (the 8-group
# arms cost twice the 4-group ones: about 2 minutes each, two at a time on 2 cores). Every seed but the first runs
# k = 2 and 4 only: 37 minutes for the first seed, 20 for each further one
MAP_HS = (10, 25, 50, 100, 250, 500)
MAP_KS = (2, 4, 8)
MAP_MORE: tuple[Setting, ...] = ((1.0, 0.5, 0), (1.4, 0.0, 0))
MAP_MORE_KS = (2, 4)


def map_specs(w: Workload, quick: bool) -> list[ArmSpec]:
    """Per k and seed: DDP, and at every H what auto picks, the paper's setting, plain averaging (each once where
    auto is one of them) and at k = 2 and 4 two more settings; k = 8 on the first seed only."""
    hs, ks = ((5, 10), (2,)) if quick else (MAP_HS, MAP_KS)
    specs = []
    for seed in w.seeds:
        for k in ks if seed == w.seeds[0] else MAP_MORE_KS:
            more = MAP_MORE if k in MAP_MORE_KS else ()
            specs += baselines(k, w, seed)[1:]
            for h in hs:
                auto = auto_arm(k, w, h, seed)
                specs.append(auto)
                specs += [diloco_arm(k, w, h, s, seed) for s in (PAPER, PLAIN, *more) if s != auto.setting]
    return specs


def streaming_specs(w: Workload, quick: bool) -> list[ArmSpec]:
    """k = 2, per seed: DDP, blocking rounds of the whole model (auto), two fragments strided and contiguous,
    blocking and overlapped by T = H/F − 2 steps (mix 0.5), strided also by shorter T, and by the longest T with
    mix 0 (the round's result alone)."""
    h, fragments = (4, 2) if quick else (20, 2)
    longest = max(h // fragments - 2, 1)
    shorter = () if quick else (2, 4)
    specs = []
    for seed in w.seeds:
        blocking = auto_arm(2, w, h, seed)
        specs += [baselines(2, w, seed)[1], blocking]
        for layout in ("strided", "contiguous"):
            split = replace(blocking, name=f"streaming-F{fragments}-{layout}", fragments=fragments, layout=layout)
            specs.append(split)
            for t in (*(shorter if layout == "strided" else ()), longest):
                specs.append(replace(split, name=f"{split.name}-T{t}", overlap=t))
        strided = replace(blocking, fragments=fragments, overlap=longest, mix=0.0)
        specs.append(replace(strided, name=f"streaming-F{fragments}-strided-T{longest}-mix0"))
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
    seed = w.seed if spec.seed is None else spec.seed
    lr = w.lr if spec.lr is None else spec.lr
    warmup = w.warmup_steps if spec.warmup_steps is None else spec.warmup_steps
    models = [load_model(w.model, seed) for _ in range(spec.groups)]  # one initialisation for all groups
    codec = None if spec.compression is None else _codec(spec.compression, models[0])
    swarm = MemorySwarm(spec.groups, codec=codec, aggregation=spec.aggregation)  # type: ignore[arg-type]
    honest = spec.groups - 1 if spec.attack else spec.groups  # an attacker leaves the honest groups' data as it was
    tokens_per_step = spec.groups * spec.batch * w.seq_length
    every = max(spec.steps // w.evals, 1)
    curve: list[tuple[int, float]] = [(0, eval_loss(models[0], corpus.held_out))]
    lock = threading.Lock()

    def group(g: int) -> None:
        model = models[g]
        data = BlockBatches(corpus.train, Shard(g % honest, honest), spec.batch, seed)
        opt, halves = inner_optimizer(model, spec, lr)
        schedule = cosine_with_warmup(opt, warmup, spec.steps)
        outer = None
        if spec.outer is not None:
            outer_lr, momentum = spec.outer
            member = swarm.member(f"g{g}")
            if g >= honest:
                member = Attacker(member, spec.attack, seed)
            outer = DiLoCo([p.data for p in model.parameters()], member, solo_group(), world_rank=g,
                           local_steps=spec.h, outer_lr=outer_lr, outer_momentum=momentum,
                           outer_warmup=spec.outer_warmup, final_step=spec.steps, fragments=fragment_runs(spec, model),
                           overlap_steps=spec.overlap, overlap_mix=spec.mix,
                           error_decay=error_decay(spec.compression))  # fmt: skip
        for step in range(1, spec.steps + 1):
            loss = inner_step(model, data.next_batch(), opt, halves)
            schedule.step()
            opt.zero_grad(set_to_none=True)
            if not math.isfinite(loss.item()):
                raise BenchError(f"arm {spec.name}: loss {loss.item()} at step {step}")
            # an OuterReport after an outer step (the groups then hold one model), None between outer steps
            synced = outer is None or outer.after_inner_step(step) is not None
            if g == 0 and synced and step % every == 0 and step < spec.steps:
                with lock:
                    curve.append((step * tokens_per_step, eval_loss(model, corpus.held_out)))

    started = time.perf_counter()
    swarm.run_groups(group, spec.groups, spec.name)
    if swarm.failed:
        raise BenchError(f"arm {spec.name}: {swarm.failed[0]}")
    final = eval_loss(models[0], corpus.held_out)
    identical = all(torch.equal(p, q) for m in models[1:] for p, q in zip(models[0].parameters(), m.parameters()))
    curve.append((spec.steps * tokens_per_step, final))
    return asdict(spec) | {
        "seed": seed,
        "wire_bytes": swarm.wire_bytes,
        "tokens": spec.steps * tokens_per_step,
        "final_eval_loss": final,
        "curve": curve,
        "groups_identical": identical,
        "wall_s": time.perf_counter() - started,
    }


def inner_optimizer(model: torch.nn.Module, spec: ArmSpec, lr: float) -> tuple[torch.optim.Optimizer, Halves | None]:
    """The trainer's inner AdamW for this arm (`parallel.build_optimizer`'s choice) and, under the galaxy's
    second moment (k = the arm's groups, all of one batch), what estimates each step's gradient variance."""
    if spec.inner_moment == "group" or spec.groups == 1:
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=ADAMW_BETAS, weight_decay=WEIGHT_DECAY), None
    opt = GalaxyAdamW(model.parameters(), lr=lr, betas=ADAMW_BETAS, weight_decay=WEIGHT_DECAY,
                      galaxy_batches=float(spec.groups))  # fmt: skip
    return opt, Halves(model.parameters())


def inner_step(model: torch.nn.Module, batch: torch.Tensor, opt: torch.optim.Optimizer, halves: Halves | None) -> torch.Tensor:
    """One inner step as `train.inner_step` takes it on one rank with one micro-batch: split in two halves under
    the galaxy's second moment. Returns the step's loss."""
    if halves is None:
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        return loss
    pieces, first, share = halves.split([batch])
    total = torch.zeros(())
    for i, piece in enumerate(pieces):
        loss = model(input_ids=piece, labels=piece, use_cache=False).loss * (len(piece) / len(batch))
        loss.backward()
        total += loss.detach()
        if i == first - 1:
            halves.snapshot()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    halves.observe(opt, share, 1.0, clip_factor(norm, GRAD_CLIP))  # type: ignore[arg-type]
    opt.step()
    return total


def fragment_runs(spec: ArmSpec, model: torch.nn.Module) -> list[list[tuple[int, int]]] | None:
    """Where each fragment sits in the model's flat parameters, as the trainer cuts them (None: one fragment)."""
    if spec.fragments == 1:
        return None
    cut = fragment_params(parameter_layers(model), spec.fragments, spec.layout)  # type: ignore[arg-type]
    return [local_runs(f, [p.numel() for p in model.parameters()]) for f in cut]


def _codec(compression: str, model: torch.nn.Module) -> object:
    """The rounds' codec of a wire format: a `--hv.compression` name, or ``sparse:DENSITY:BITS:RULE``."""
    # hivemind, for the codecs that wrap its quantizers
    from diloco.swarm.rounds.codecs import WIRE_FORMATS, sparse_codec

    if compression.startswith("sparse:"):
        _, density, bits, _ = compression.split(":")
        return sparse_codec([tuple(p.shape) for p in model.parameters()], float(density), int(bits))
    return WIRE_FORMATS[compression].tcp


def error_decay(compression: str | None) -> float | None:
    """A sparse wire format's error-feedback decay by its rule (as `HvConfig.error_feedback`); None: dense."""
    if not compression or not compression.startswith("sparse:"):
        return None
    return 0.95 if compression.split(":")[3] == "sparseloco" else 1.0


# ---------------------------------------------------------------- arms in parallel

# runs one arm in a pool process: (its spec, the workload, the corpus) -> its figures; module-level (pickled)
ArmRunner = Callable[[Any, "Workload", "Corpus"], dict[str, Any]]
_WORKER: dict[str, Any] = {}  # per pool process: its workload and corpus, loaded once by `_start_worker`


def _start_worker(w: Workload, data: Path, run: ArmRunner) -> None:
    torch.set_num_threads(1)
    logging.getLogger("diloco").setLevel(logging.ERROR)  # a line per outer step would bury the results
    _WORKER.update(w=w, corpus=load_corpus(w, data), run=run)


def _run_in_worker(spec: Any) -> dict[str, Any]:
    return _WORKER["run"](spec, _WORKER["w"], _WORKER["corpus"])


def run_arms(specs: Sequence[Any], w: Workload, data: Path, workers: int,
             run: ArmRunner | None = None) -> Iterator[dict[str, Any]]:  # fmt: skip
    """Every arm (anything with a `cost()`, the costliest first) run by `run` (a module-level function, default
    `run_arm`) in `workers` processes of one torch thread; yields results as they end."""
    order = sorted(specs, key=lambda spec: spec.cost(), reverse=True)
    context = get_context("spawn")  # no forked copy of this process's threads and torch state
    initargs = (w, data, run or run_arm)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=initargs) as pool:
        futures = [pool.submit(_run_in_worker, spec) for spec in order]
        for future in as_completed(futures):
            yield future.result()


def run_all(specs: Sequence[Any], w: Workload, data: Path, info: dict[str, Any],
            run: ArmRunner | None = None) -> tuple[list[dict[str, Any]], int]:  # fmt: skip
    """`run_arms` with a worker per usable core (at most one per arm), logging each arm as it ends. Returns the runs
    in the order they ended, and the number of workers."""
    log = logging.getLogger("diloco")
    workers = max(1, min(info["usable_cores"], len(specs)))
    runs: list[dict[str, Any]] = []
    for result in run_arms(specs, w, data, workers, run):
        runs.append(result)
        k = f" k={result['k']}" if "k" in result else ""
        log.info("bench arm %d/%d%s %s seed %d: eval loss %.4f (%.0f s)", len(runs), len(specs), k, result["name"],
                 result["seed"], result["final_eval_loss"], result["wall_s"])  # fmt: skip
    return runs, workers


# ---------------------------------------------------------------- the bench


def measure(quick: bool, work_dir: Path, info: dict[str, Any], data: Path, study: str = "defaults") -> dict[str, Any]:
    """Every arm of `study` on the text file `data`; gaps against DDP (per seed and on the seeds' mean)."""
    w = workload(quick, study)
    w = replace(w, model=model_folder(w.model, work_dir / "models"))
    load_corpus(w, data)  # a bad --data fails here, once, not in every worker
    specs = {"defaults": defaults_specs, "map": map_specs, "streaming": streaming_specs}[study](w, quick)
    runs, workers = run_all(specs, w, data, info)
    params = sum(p.numel() for p in load_model(w.model, 0).parameters())
    return {
        "study": study,
        "workload": asdict(w) | {"model": str(w.model), "corpus": str(data.resolve()), "parameters": params},
        "workers": workers,
        **summarize(runs, specs, study),
    }


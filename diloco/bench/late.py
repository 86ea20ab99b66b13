"""`diloco bench convergence --study late`: a group that comes to its boundary after the swarm's round formed
without it, its inner steps kept (`--hv.late-work keep`, the default) or dropped (`drop`), against no lateness, in
held-out loss.

The defaults study's workload (the ~1M-parameter model, seq 128, B = 8, S = 200, H = 25: 8 rounds) and outer setting
(`auto`, what the trainer picks with no outer flags, its inner moment too), at k = 2 (group 1 late) and k = 4 (groups
2 and 3 late), seeds 0 and 1. Per k and seed:

- `ontime`: nobody is late (the defaults study's `diloco-H25-auto`, through this study's loop);
- `late-{keep,drop}-odd`: the late groups come late to rounds 1, 3, 5 and 7. Under keep a late group loads the
  others' state, goes to the swarm's next round at once (`DiLoCo._next_round_now`) and its steps land there; under
  drop it loads, discards its steps and trains the next round's from the loaded state;
- `late-{keep,drop}-every`: the late groups come late to every boundary they reach by training (rounds 1 to 7): a
  group that is always slower than the others. Under keep its jump to the next boundary puts it on time there, so
  it is late at rounds 1, 3, 5, 7 as above; under drop it is late again at every round, and only its last lands.

No group is late to the last round (the end of the run): nothing could carry its steps on, under either setting.

How lateness is made, in memory (`LateHub`): round r averages the groups that came to it. A group that is late for r
says so at its boundary (the round forms without it, as the real swarm's does once matchmaking stops waiting), waits
until the others applied round r and published their progress records, and only then calls the outer loop, which
finds them ahead (`_plan`) and loads their state (`_load_from`): the product's own path. The on-time groups wait
until every late group downloaded their state before their next inner step, so the state it loads holds their step
count at the boundary: which rounds a group misses and the steps it takes over never depend on the threads' timing.
With 2 groups the on-time group's round has nobody else: it applies its own pseudo-gradient alone, as a real group
that finds nobody does.

Tokens: under keep a late group skips the H inner steps of the round it jumps over, so it trains fewer tokens than
the others (every one of them lands, one round stale); under drop it trains all S steps, and those of every round it
was late for are thrown away. Each arm reports per group the inner steps trained, discarded and carried, and the
swarm's tokens trained and landed: the arms are compared at the same schedule (S = 200 inner steps per group,
8 rounds), not at equal tokens trained.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.bench import BenchError
from diloco.bench.convergence import (
    Corpus,
    Workload,
    auto_arm,
    eval_loss,
    inner_optimizer,
    inner_step,
    load_corpus,
    run_all,
    workload,
)
from diloco.bench.convergence_report import arm_figures, workload_text
from diloco.bench.models import model_folder
from diloco.data import BlockBatches, Shard
from diloco.model import load_model
from diloco.outer.diloco import DiLoCo
from diloco.outer.links import solo_group
from diloco.outer.memory import Member, MemorySwarm, Report, State
from diloco.schedule import cosine_with_warmup
from diloco.swarm.records.progress import Progress
from diloco.swarm.rounds.group_round import abreast

__all__ = ["LateArm", "LateHub", "late_specs", "late_workload", "markdown", "measure", "plot", "run_late_arm"]

WAIT_S = 600.0  # the longest a group waits for the others at a round (a bug, not a slow machine, past that)
PATTERNS = ("odd", "every")
POLICIES = ("keep", "drop")


def late_workload(quick: bool) -> Workload:
    """The defaults study's workload (its inner schedule: lr 3e-3, 20 warm-up steps), seeds 0 and 1; `quick`: a
    few seconds of compute with 4 rounds."""
    if quick:
        return Workload("llama-1m-bytes", 32, 4, 12, 3e-3, 2, 2, 2)
    return replace(workload(False), seeds=(0, 1), schedules=())


def late_h(quick: bool) -> int:
    return 3 if quick else 25


@dataclass(frozen=True)
class LateArm:
    """One arm: k groups, H, the outer setting `auto` picks; `late_groups` come late to the rounds of `pattern`."""

    name: str
    k: int
    h: int
    seed: int
    late_work: str = "keep"
    pattern: str = ""  # "" (nobody late), "odd" or "every"
    late_groups: tuple[int, ...] = ()

    def cost(self) -> int:
        return self.k

    def late_rounds(self, steps: int) -> frozenset[int]:
        """The rounds a late group comes late to when it reaches their boundary by training (never the last)."""
        rounds = math.ceil(steps / self.h)
        if self.pattern == "odd":
            return frozenset(range(1, rounds, 2))
        if self.pattern == "every":
            return frozenset(range(1, rounds))
        return frozenset()


def late_specs(w: Workload, quick: bool) -> list[LateArm]:
    """Per k and seed: ontime, and keep and drop for each pattern; the last group (k = 2) or two (k = 4) late."""
    h, ks = late_h(quick), ((2,) if quick else (2, 4))
    specs = []
    for seed in w.seeds:
        for k in ks:
            late = tuple(range(k - max(1, k // 2), k))
            specs.append(LateArm("ontime", k, h, seed))
            for pattern in PATTERNS:
                for policy in POLICIES:
                    specs.append(LateArm(f"late-{policy}-{pattern}", k, h, seed, policy, pattern, late))
    return specs


# ---------------------------------------------------------------- rounds of whoever came


class LateHub(MemorySwarm):
    """The in-memory swarm with rounds of a subset: round r forms once every group came to it or said it is late
    for it (`come_late`), and averages those that came (the exact mean, summed in one order: `MemorySwarm.combine`;
    a group behind the others' outer step sits it out, `abreast`). It also tells the groups when a round was applied
    (`wait_applied`: the progress records show it) and when the late groups downloaded a state (`wait_fetched`)."""

    def __init__(self, groups: int) -> None:
        super().__init__(groups)
        self.groups = groups
        self.cond = threading.Condition()
        self.came: dict[int, list[str]] = {}  # round -> peers that came to it
        self.inputs: dict[int, dict[str, tuple[list[torch.Tensor], float, int | None]]] = {}
        self.late: dict[int, set[str]] = {}  # round -> peers late for it
        self.late_at: dict[str, int] = {}  # peer -> the last round it was late for
        self.fetched: dict[int, set[str]] = {}  # round -> late peers that downloaded a state since
        self.means: dict[int, tuple[list[str], list[torch.Tensor]]] = {}
        self.reads: dict[int, int] = {}

    def member(self, peer_id: str, owner: str | None = None) -> LateMember:
        return LateMember(self, peer_id, owner)

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        with self.cond:
            while not ready():
                if self.failed:
                    raise BenchError(f"stopped waiting for {what}: {self.failed[0]}")
                if time.monotonic() > deadline:
                    raise BenchError(f"waited {WAIT_S:.0f} s for {what}")
                self.cond.wait(0.5)

    def _formed(self, r: int) -> bool:
        return len(self.came.get(r, ())) + len(self.late.get(r, ())) >= self.groups

    def average(self, peer: str, r: int, tensors: list[torch.Tensor], weight: float,
                outer_step: int | None) -> tuple[list[str], list[torch.Tensor] | None]:  # fmt: skip
        """Come to round r; returns the peers whose contributions were averaged and the mean (None: sat out)."""
        with self.cond:
            self.came.setdefault(r, []).append(peer)
            self.inputs.setdefault(r, {})[peer] = (tensors, weight, outer_step)
            self.cond.notify_all()
        self._wait(lambda: self._formed(r), f"round {r}")
        with self.cond:
            if r not in self.means:
                names = sorted(self.inputs[r])  # one summation order: the same bytes in every group
                kept = [names[i] for i in abreast([self.inputs[r][n][2] for n in names], r)]
                self.means[r] = (kept, self.combine([self.inputs[r][n][:2] for n in kept]))
            kept, mean = self.means[r]
            self.reads[r] = self.reads.get(r, 0) + 1
            if self.reads[r] == len(self.came[r]):  # the last one out frees the round's tensors
                del self.inputs[r], self.means[r]
            return kept, (mean if peer in kept else None)

    def come_late(self, peer: str, r: int) -> None:
        """`peer` reaches round r's boundary after the round formed without it."""
        with self.cond:
            self.late.setdefault(r, set()).add(peer)
            self.late_at[peer] = r
            self.cond.notify_all()

    def wait_applied(self, r: int) -> None:
        """Until round r formed and every group that came to it published a progress record of outer step r or
        later (the state a late group then finds ahead)."""

        def applied() -> bool:
            steps = {record.owner: record.outer_step for record in self.records.values()}
            return self._formed(r) and all(steps.get(peer, -1) >= r for peer in self.came.get(r, ()))

        self._wait(applied, f"the others' round {r}")

    def fetched_state(self, peer: str) -> None:
        with self.cond:
            if peer in self.late_at:
                self.fetched.setdefault(self.late_at[peer], set()).add(peer)
                self.cond.notify_all()

    def wait_fetched(self, r: int) -> None:
        """Until every group late for round r downloaded a state since."""
        self._wait(lambda: self.late.get(r, set()) <= self.fetched.get(r, set()), f"the late groups of round {r}")

    def published(self) -> None:
        with self.cond:
            self.cond.notify_all()


class LateMember(Member):
    """A group's link to a `LateHub`."""

    swarm: LateHub

    def average(self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: Callable[[], bool],
                fragment: int | None = None, outer_step: int | None = None, last: bool = False) -> Report:  # fmt: skip
        sent = [self.swarm.wire(t, count=True) for t in tensors]
        kept, mean = self.swarm.average(self.peer_id, round_index, sent, weight, outer_step)
        if mean is None:
            return Report(num_peers=len(kept) + 1, ok=False, behind=True)
        for tensor, value in zip(tensors, mean):
            tensor.copy_(value)
        return Report(num_peers=len(kept), round_id=f"r{round_index}" if len(kept) > 1 else "")

    def publish(self, record: Progress) -> None:
        super().publish(record)
        self.swarm.published()

    def download_state(self, record: Progress, rank: int,
                       wanted: Callable[[dict[str, Any]], bool] | None = None) -> State | None:  # fmt: skip
        got = super().download_state(record, rank, wanted)
        if got is not None and got[1]:  # (not an answer cut after its metadata)
            self.swarm.fetched_state(self.peer_id)
        return got


# ---------------------------------------------------------------- one arm


def follow_schedule(schedule: torch.optim.lr_scheduler.LRScheduler, step: int) -> None:
    """The LR schedule at inner step `step` (`diloco.train.trainer.follow_schedule`: a group that took the swarm's
    step count goes on from there)."""
    if schedule.last_epoch == step:
        return
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended
        warnings.simplefilter("ignore", UserWarning)
        schedule.last_epoch = step - 1
        schedule.step()


def run_late_arm(arm: LateArm, w: Workload, corpus: Corpus) -> dict[str, Any]:
    """Train one arm: k groups in threads over a `LateHub`, each through the trainer's loop (inner step, the outer
    loop's `after_inner_step`, the LR schedule following the step it returns, `finish`). Returns the final eval loss
    of group 0 (every group holds its model), its eval curve, and per group what it trained, discarded and carried."""
    base = auto_arm(arm.k, w, arm.h, arm.seed)
    tokens_per_step = base.batch * w.seq_length
    hub = LateHub(arm.k)
    models = [load_model(w.model, arm.seed) for _ in range(arm.k)]  # one initialisation for all groups
    outer_lr, momentum = base.outer  # type: ignore[misc]
    setting = {"local_steps": arm.h, "outer_lr": outer_lr, "outer_momentum": momentum,
               "outer_warmup": base.outer_warmup, "final_step": base.steps}  # fmt: skip
    outers = [DiLoCo([p.data for p in models[g].parameters()], hub.member(f"g{g}"), solo_group(), world_rank=g,
                     tokens_per_step=tokens_per_step, late_work=arm.late_work, **setting)
              for g in range(arm.k)]  # fmt: skip
    for outer in outers:
        outer.join(0)
    late_rounds = arm.late_rounds(base.steps)
    every = max(base.steps // w.evals, 1)
    curve: list[tuple[int, float]] = [(0, eval_loss(models[0], corpus.held_out))]
    groups: dict[int, dict[str, Any]] = {}

    def group(g: int) -> None:
        model, outer, peer = models[g], outers[g], f"g{g}"
        data = BlockBatches(corpus.train, Shard(g, arm.k), base.batch, arm.seed)
        opt, halves = inner_optimizer(model, base, w.lr)
        schedule = cosine_with_warmup(opt, w.warmup_steps, base.steps)
        step = trained = 0
        late, rows = [], []
        while step < base.steps:
            loss = inner_step(model, data.next_batch(), opt, halves)
            schedule.step()
            opt.zero_grad(set_to_none=True)
            if not math.isfinite(loss.item()):
                raise BenchError(f"arm {arm.name}: loss {loss.item()} in group {g} at step {step + 1}")
            step, trained = step + 1, trained + 1
            r = step // arm.h
            if g in arm.late_groups and step % arm.h == 0 and r in late_rounds:
                late.append(r)
                hub.come_late(peer, r)  # the round forms without this group: it gets there once it was applied
                hub.wait_applied(r)
            report = outer.after_inner_step(step)
            if report is None:
                continue
            rows += report.rows
            if report.step != step:  # it took the swarm's step count (a late group under keep skips a round)
                step = report.step
                follow_schedule(schedule, step)
            r = step // arm.h
            if step % arm.h == 0 and peer not in hub.late.get(r, ()):
                hub.wait_fetched(r)  # the late groups load the state of this boundary, before anyone trains on
            if g == 0 and step % every == 0 and step < base.steps:
                curve.append((step, eval_loss(model, corpus.held_out)))
        final = outer.finish()
        rows += [] if final is None else [final]
        summary = outer.summary()
        carried = [row for row in rows if row.get("carried_steps")]
        groups[g] = {
            "world_rank": g,
            "late": g in arm.late_groups,
            "late_rounds": late,
            "trained_steps": trained,
            "trained_tokens": trained * tokens_per_step,
            "discarded_steps": summary["discarded_steps"],
            "discarded_tokens": summary["discarded_tokens"],
            "carried_steps": sum(row.get("carried_steps", 0) for row in rows),
            "carried_rows": sum("carried_steps" in row for row in rows),
            # the rounds its kept steps landed in: (outer step, groups averaged, its weight)
            "carried_rounds": [(row["outer_step"], row.get("num_peers"), row.get("weight")) for row in carried],
            "loads": sum("loaded_state_from" in row for row in rows),
            "outer_steps": summary["outer_steps"],
            "outer_digest": outer.digest,
        }

    started = time.perf_counter()
    try:
        hub.run_groups(group, arm.k, arm.name)
    finally:
        for outer in outers:
            outer.close()
    if hub.failed:
        raise BenchError(f"arm {arm.name} k={arm.k} seed {arm.seed}: {hub.failed[0]}")
    final = eval_loss(models[0], corpus.held_out)
    identical = all(torch.equal(p, q) for m in models[1:] for p, q in zip(models[0].parameters(), m.parameters()))
    curve.append((base.steps, final))
    per_group = [groups[g] for g in range(arm.k)]
    trained = sum(g["trained_tokens"] for g in per_group)
    return asdict(arm) | {
        "outer": list(base.outer or ()),
        "outer_warmup": base.outer_warmup,
        "inner_moment": base.inner_moment,
        "steps": base.steps,
        "batch": base.batch,
        "late_at": sorted(late_rounds),
        "final_eval_loss": final,
        "curve": curve,
        "groups_identical": identical,
        "one_state": len({g["outer_digest"] for g in per_group}) == 1,
        "groups": per_group,
        "swarm_tokens_trained": trained,
        "swarm_tokens_landed": trained - sum(g["discarded_tokens"] for g in per_group),
        "wall_s": time.perf_counter() - started,
    }


# ---------------------------------------------------------------- arms in parallel

def measure(quick: bool, work_dir: Path, info: dict[str, Any], data: Path, study: str = "late") -> dict[str, Any]:
    """Every arm of the late study on the text file `data`, and keep against drop and both against ontime."""
    w = late_workload(quick)
    w = replace(w, model=model_folder(w.model, work_dir / "models"))
    load_corpus(w, data)  # a bad --data fails here, once, not in every worker
    specs = late_specs(w, quick)
    runs, workers = run_all(specs, w, data, info, run_late_arm)  # the 4-group arms first (`LateArm.cost`)
    params = sum(p.numel() for p in load_model(w.model, 0).parameters())
    return {
        "study": "late",
        "workload": asdict(w) | {"model": str(w.model), "corpus": str(data.resolve()), "parameters": params},
        "h": late_h(quick),
        "workers": workers,
        **summarize(runs, specs),
    }


# ---------------------------------------------------------------- the figures


def summarize(runs: list[dict[str, Any]], specs: list[LateArm]) -> dict[str, Any]:
    """The arms (runs of one name and k over the seeds, in the order of `specs`), each against ontime of the same k
    and seed, and per k and pattern keep against drop."""
    order = list(dict.fromkeys((s.k, s.name) for s in specs))
    arms = [_arm(sorted((r for r in runs if (r["k"], r["name"]) == key), key=lambda r: r["seed"])) for key in order]
    ontime = {(a["k"], seed): loss for a in arms if a["name"] == "ontime"
              for seed, loss in zip(a["seeds"], a["final_eval_loss"])}  # fmt: skip
    for arm in arms:
        gaps = [loss / ontime[arm["k"], seed] - 1 for seed, loss in zip(arm["seeds"], arm["final_eval_loss"])]
        arm["vs_ontime_by_seed"], arm["vs_ontime"] = gaps, float(np.mean(gaps))
    return {"arms": arms, "keep_vs_drop": keep_vs_drop(arms)}


def _arm(runs: list[dict[str, Any]]) -> dict[str, Any]:
    kept = ("name", "k", "h", "late_work", "pattern", "late_groups", "late_at", "outer", "outer_warmup",
            "inner_moment", "steps", "batch")  # fmt: skip
    return arm_figures(runs, kept) | {
        "one_state": all(r["one_state"] for r in runs),
        "groups_by_seed": [r["groups"] for r in runs],
        "swarm_tokens_trained": [r["swarm_tokens_trained"] for r in runs],
        "swarm_tokens_landed": [r["swarm_tokens_landed"] for r in runs],
    }


def keep_vs_drop(arms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per k and pattern: the mean eval loss of ontime, keep and drop, keep − drop (absolute, and keep ÷ drop − 1 per
    seed and on average), and each against ontime."""
    by = {(a["k"], a["name"]): a for a in arms}
    out = []
    for k in dict.fromkeys(a["k"] for a in arms):
        for pattern in PATTERNS:
            keep, drop = by.get((k, f"late-keep-{pattern}")), by.get((k, f"late-drop-{pattern}"))
            if keep is None or drop is None:
                continue
            rel = [a / b - 1 for a, b in zip(keep["final_eval_loss"], drop["final_eval_loss"])]
            out.append({
                "k": k, "pattern": pattern, "seeds": keep["seeds"],
                "ontime": by[k, "ontime"]["mean_eval_loss"], "keep": keep["mean_eval_loss"],
                "drop": drop["mean_eval_loss"], "keep_minus_drop": keep["mean_eval_loss"] - drop["mean_eval_loss"],
                "keep_vs_drop_by_seed": rel, "keep_vs_drop": float(np.mean(rel)),
                "keep_better_seeds": sum(r < 0 for r in rel),
                "keep_vs_ontime": keep["vs_ontime"], "drop_vs_ontime": drop["vs_ontime"],
            })  # fmt: skip
    return out


# ---------------------------------------------------------------- the section


def _outer(arm: dict[str, Any]) -> str:
    """The outer setting as the other studies' tables write it: lr/momentum, `wN` for N outer warm-up steps."""
    lr, momentum = arm["outer"]
    moment = ", galaxy moment" if arm["inner_moment"] == "galaxy" else ""
    return f"{lr:g}/{momentum:g}" + (f" w{arm['outer_warmup']}" if arm["outer_warmup"] else "") + moment


def _pattern(result: dict[str, Any], pattern: str) -> str:
    """The rounds of `pattern` (those a late group is late for when it reaches them by training), as run."""
    rounds = next((a["late_at"] for a in result["arms"] if a["pattern"] == pattern), [])
    return ", ".join(map(str, rounds)) or "–"


def _late_groups(arm: dict[str, Any]) -> list[dict[str, Any]]:
    """The first seed's late groups (the pattern makes every seed's the same)."""
    return [g for g in arm["groups_by_seed"][0] if g["late"]]


def _rounds(arm: dict[str, Any]) -> str:
    late = _late_groups(arm)
    return ", ".join(map(str, late[0]["late_rounds"])) if late and late[0]["late_rounds"] else "–"


def _steps(arm: dict[str, Any]) -> str:
    """Inner steps each group trained (first seed), on-time and late groups apart when they differ."""
    groups = arm["groups_by_seed"][0]
    ontime = {g["trained_steps"] for g in groups if not g["late"]}
    late = [g for g in groups if g["late"]]
    text = "/".join(map(str, sorted(ontime)))
    return text + (f"; late {'/'.join(str(g['trained_steps']) for g in late)}" if late else "")


def _lost(arm: dict[str, Any]) -> str:
    late = _late_groups(arm)
    if not late:
        return "–"
    return ", ".join(f"{g['discarded_steps']} / {g['carried_steps']} ({g['carried_rows']} rows)" for g in late)


def markdown(result: dict[str, Any]) -> str:
    from diloco.bench import section_head

    w, h = result["workload"], result["h"]
    lines = [
        *section_head(result),
        (f"- study `late`: {workload_text(w)}; H = {h}, outer setting `auto` (what the trainer picks with no outer "
         "flags; with it the inner moment)"),
        ("- arms per k and seed: `ontime` (nobody late); `late-keep-P` and `late-drop-P` (`--hv.late-work`): the "
         "last group (k = 2) or two (k = 4) come to their boundary after the swarm's round formed without them, find "
         "the others ahead in the progress records and load their state (the product's `DiLoCo`); P = `odd`: late "
         f"at rounds {_pattern(result, 'odd')}; P = `every`: late at every round reached by training but the last "
         f"({_pattern(result, 'every')}: a group always slower than the others; under keep its jump to the next "
         "boundary puts it on time there)"),
        ("- in memory (`diloco.bench.late.LateHub`): a round averages the groups that came (with 2 groups the "
         "on-time one applies its own pseudo-gradient, alone); the groups run as threads of one process, "
         f"{result['workers']} arms at a time, one torch thread each (wall s follow that)"),
        ("- tokens: the arms share the schedule (S inner steps per group), not the tokens trained: under keep a late "
         "group skips the round it jumps over (fewer steps trained, all landing one round stale); under drop it "
         "trains every step and the late rounds' are thrown away. Steps are of the first seed (every seed's are "
         "the same); swarm tokens trained / landed in thousands"),
        (f"- 1-minute load average at start / end: {result['machine']['load_avg_1m']:.1f} / "
         f"{result['load_avg_1m_end']:.1f}"),
    ]
    if "plot" in result:
        lines.append(f"- plot: ![eval loss]({result['plot']})")
    lines += ["", ("| k | arm | outer | late at rounds | steps trained per group | late: discarded / carried "
                   "steps | swarm tokens trained / landed (k) | eval loss per seed | mean | vs ontime | wall s |"),
              "|---:|---|---|---|---|---|---|---|---:|---:|---:|"]  # fmt: skip
    for a in result["arms"]:
        losses = ", ".join(f"{loss:.4f}" for loss in a["final_eval_loss"])
        tokens = f"{a['swarm_tokens_trained'][0] / 1e3:.1f} / {a['swarm_tokens_landed'][0] / 1e3:.1f}"
        lines.append(
            f"| {a['k']} | {a['name']} | {_outer(a)} | {_rounds(a)} | {_steps(a)} | {_lost(a)} | "
            f"{tokens} | {losses} | {a['mean_eval_loss']:.4f} | {a['vs_ontime'] * 100:+.2f}% | {a['wall_s']:.0f} |"
        )
    lines += ["", ("Keep against drop, mean over the seeds (keep − drop: eval loss; keep vs drop: keep ÷ drop − 1, "
                   "per seed in brackets):"), "",
              "| k | late | ontime | keep | drop | keep − drop | keep vs drop | keep vs ontime | drop vs ontime |",
              "|---:|---|---:|---:|---:|---:|---|---:|---:|"]  # fmt: skip
    for c in result["keep_vs_drop"]:
        seeds = ", ".join(f"{g * 100:+.2f}%" for g in c["keep_vs_drop_by_seed"])
        lines.append(
            f"| {c['k']} | {c['pattern']} | {c['ontime']:.4f} | {c['keep']:.4f} | {c['drop']:.4f} | "
            f"{c['keep_minus_drop']:+.4f} | {c['keep_vs_drop'] * 100:+.2f}% ({seeds}) | "
            f"{c['keep_vs_ontime'] * 100:+.2f}% | {c['drop_vs_ontime'] * 100:+.2f}% |"
        )
    return "\n".join(lines) + "\n"


def stem(quick: bool, **_options: Any) -> str:
    """The name of the study's JSON and PNG (``diloco.bench.run`` asks for it)."""
    return "convergence-late" + ("-quick" if quick else "")


def plot(result: dict[str, Any], out: Path) -> Path:
    """Eval loss of group 0 against its inner step, per k, every arm (the first seed), in `out`."""
    path = out / f"{stem(result['quick'])}.png"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({a["k"] for a in result["arms"]})
    fig, axes = plt.subplots(1, len(ks), figsize=(5.5 * len(ks), 4.5), squeeze=False)
    for ax, k in zip(axes[0], ks):
        for arm in (a for a in result["arms"] if a["k"] == k):
            steps, losses = zip(*arm["curve"])
            style = "-" if arm["name"] == "ontime" else "--" if arm["late_work"] == "drop" else ":"
            ax.plot(steps, losses, style, marker=".", label=arm["name"])
        ax.set(xlabel="inner step of group 0 (on time)", ylabel="held-out loss", title=f"k = {k}")
        bottom, top = ax.get_ylim()
        if bottom < 3.5:
            ax.set_ylim(top=min(top, 3.5))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"convergence, study late, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

"""`diloco bench hetero`: three worker groups whose speeds really differ, each throttled by the kernel (a cgroup
CPU quota: `diloco.bench.throttle`), in three swarm arms, and the same arms on three equal groups, on real text:

- `old-fixed`: the trainer's former defaults, `--hv.pace fixed --hv.matchmaking-time 5 --hv.late-work drop`;
- `fixed`: `--hv.pace fixed`, every other flag at its default (matchmaking `auto`, late work kept);
- `tokens`: `--hv.pace tokens`, every other flag at its default (a swarm-wide token budget N = H × 3 × tokens per
  inner step of the first group, announced to the others);
- `tokens-galaxy` (unequal trio only, no part of the decision): `tokens` with `--hv.inner-moment galaxy`, each
  step's lone micro-batch split in two halves for the galaxy's second moment: what that costs per inner step
  against the default (`auto` takes plain AdamW, the solo runs', where it would split a lone micro-batch).

Every arm passes `--hv.local-steps H` and pins the outer SGD at lr 1.0, momentum 0 (measured best for small H here:
`auto` would pick by run length, the same in every arm); `--hv.averaging-timeout` is left at its default.

Cores: the unequal trio holds 0.8 / 0.4 / 0.2 of a core (4:2:1), not the 1.0 / 0.5 / 0.25 the issue names: 1.75
cores of quota would leave 0.25 of this 2-core machine for everything that runs outside the quotas, and that took
more. This bench measures it (docs/benchmarks.md, 2026-11-27 12:24): the three groups' DHT, p2pd and averager
processes, the bootstrap `diloco dht`, the bench and every other process took 0.26 of a core beside the tokens arm
and 0.81 beside the unequal fixed arm (a group waiting for a round keeps its helpers busy: 0.35 of a core for the
fastest). At 1.75 the trainers would wait for the machine, not for each other, and a ratio to the solo runs (each
alone, with the machine to itself) would measure the host. The 1.4 cores here leave 0.6. The equal trio holds the
middle share (0.4) in each group, and its solo tokens/s is the middle group's, measured once.

Every group is one `python -m diloco.train` process (one rank) on loopback, in its own cgroup from its start;
nothing in the trainer sleeps. The quota is set once the trainer has created its metrics.jsonl (imports done,
model built, swarm joined, nothing trained): start-up, which no figure counts, would otherwise take four times
longer in the slowest group. Then its DHT, p2pd and averager processes move to a second cgroup of the group's with
no quota (counted, not held: a slower accelerator, not a slower host) and the bench moves any later child there
too. Only steps that began after the quota was set count in a tokens/s (the bench may notice a ready trainer a
moment late). Phases, one after another:

- solo: each group alone on the machine, one after the other (`--quick`: all three at once), as a galaxy of its
  own (galaxy size 1: no DHT, no averaging); tokens/s = its inner-step tokens ÷ inner-step time (the
  `tokens_per_s` rows after the warm-up, combined as a harmonic mean: a step the kernel parked counts with its
  full time);
- solo side by side (the full run): each trio's three solo runs at once, with their quotas: what three trainers
  sharing this machine's two cores lose before any swarm (caches, memory bandwidth, the host), which a ratio to
  the solo runs alone counts against the swarm; the arms' tokens/s are given against both sums;
- each arm on the unequal trio, then on the equal one (`--quick`: tokens on the unequal trio), with
  galaxy size 3 and `--max-steps S`: under fixed H every group trains S inner steps (a late one under `keep` skips
  the round it jumps over), under the token budget the swarm trains 3 × S steps' worth of tokens in as many rounds;
- a dead group (`diloco.bench.hetero_dead`) and, the full run only, a group away on evaluations
  (`diloco.bench.hetero_pause`), both on the equal trio;
- the full run only: solo again, as before the arms. Each group's solo figures are the mean of both runs, and their
  ratio is the host's drift meanwhile (`diloco.bench.hetero_solo`); each arm's ratio is also given against either.

An arm's wall time runs from the first inner step of any group to the last outer step of any group (metrics
rows carry unix times); its tokens/s (a group's, the swarm's) is the tokens of the steps that began once every
quota was set ÷ the wall time from then on, rounds included (the arms evaluate once, after the last round, as the
solo runs do not evaluate at all). Per arm and group: the inner steps discarded (summary.json), the share of rounds
that had every group (`num_peers` = 3 in the outer rows) and the final eval loss.

Where the time goes: every SAMPLE_S seconds a thread (`hetero_sampler`) reads each group's cgroups (the quota's CPU
seconds and throttling, the helpers' CPU seconds), the training process's main thread (/proc), the bootstrap DHT's
cgroup, this process and the machine (/proc/stat). Integrated over each group's inner steps they give the training
process's CPU seconds per step and the cores it ran at inside its steps, against the same two figures alone: their
ratio is the step speed in the swarm ÷ solo, split into "more CPU per step" and "less CPU per second". Over the
arm's window: the helpers', the bootstrap DHT's, this bench's and every other process's core-seconds against the
spare capacity the quotas leave ((cores − Σ quotas) × wall), and each group's time in inner steps, rounds,
evaluation and after its last round. Targets are reported, never asserted (`targets`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shlex
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from diloco import procs
from diloco.bench import BenchError
from diloco.bench.hetero_dead import DEAD_AFTER, DEAD_GROUP, dead_figures
from diloco.bench.hetero_pause import PAUSE_EVAL_STEPS, PAUSED_GROUP, pause_figures
from diloco.bench.hetero_report import (
    Counters,
    arm_figures,
    explain,
    markdown,
    plot,
    step_cpu,
    targets,
    usable_cores,
)
from diloco.bench.hetero_sampler import Sampler
from diloco.bench.hetero_solo import bracket
from diloco.bench.models import write_model
from diloco.bench.throttle import CpuLimit
from diloco.bench.wire import dht_peers, last_line, started, summary, wait_all
from diloco.corpus import TINYSHAKESPEARE

__all__ = ["markdown", "measure", "plot", "read_rows"]

log = logging.getLogger("diloco")

CORES = (0.8, 0.4, 0.2)  # the unequal trio's shares of a core, fastest first (4:2:1; see the docstring)
EQUAL = CORES[1]  # each group's share in the equal trio: its solo tokens/s is the middle group's
TRIOS = {"unequal": CORES, "equal": (EQUAL,) * len(CORES)}
MODEL = "llama-1m-bytes"  # in `bench.models`: holds the byte tokenizer's ids
ARM_FLAGS = {  # each arm's pace, rendezvous and late work; everything else at the trainer's defaults
    "old-fixed": ["--hv.pace", "fixed", "--hv.matchmaking-time", "5", "--hv.late-work", "drop"],
    "fixed": ["--hv.pace", "fixed"],
    "tokens": ["--hv.pace", "tokens"],
    # not an arm of the decision: tokens with the galaxy moment, to measure what its halves of a lone micro-batch
    # cost per inner step against the default's plain AdamW (that of the solo runs)
    "tokens-galaxy": ["--hv.pace", "tokens", "--hv.inner-moment", "galaxy"],
}
ARMS = tuple(ARM_FLAGS)
DIAGNOSTIC = {"tokens-galaxy": ("unequal",)}  # runs on these trios only
DEAD_ARM = "tokens"  # the dead-group arm's flags (`dead_arm`): the default pace
PAUSE_ARM = "fixed"  # the paused-group arm's (`pause_arm`): rounds due at an inner step, as after a pause matters
QUICK_ARMS = (("unequal", "tokens"),)  # a smoke test of the default pace; the full run compares the paces
MOMENT = re.compile(r"inner AdamW moment (\w+)")  # the trainer's start-up line
ENGAGE_POLL_S = 0.02  # how often a starting trainer is looked at: its quota is set within this of being ready


@dataclasses.dataclass(frozen=True)
class HeteroSetup:
    """What every phase trains. Tokens per inner step = seq_length × batch (one rank per group)."""

    seq_length: int
    batch: int
    steps: int  # --max-steps of each arm: inner steps per group under fixed H
    local_steps: int  # H
    solo_steps: int  # inner steps of the fastest group alone (slower ones: fewer, in proportion to their cores)
    skip: int  # warm-up rows left out of the solo tokens/s
    warmup_steps: int
    eval_steps: int  # held-out batches per evaluation
    timeout_s: float  # per phase, start-up included

    @property
    def tokens_per_step(self) -> int:
        return self.seq_length * self.batch

    @property
    def target_tokens(self) -> int:
        """The token budget `--hv.pace tokens` derives: what fixed H trains in one round over the swarm."""
        return self.local_steps * len(CORES) * self.tokens_per_step


def hetero_setup(quick: bool) -> HeteroSetup:
    """Quick: 256 tokens per step, 2 rounds of H = 4. Full: 1024 tokens per step (the demo's), 6 rounds of 20, an
    eval of 8 batches (64k held-out tokens) for the arms' loss comparison."""
    if quick:
        return HeteroSetup(seq_length=64, batch=4, steps=8, local_steps=4, solo_steps=12, skip=2, warmup_steps=2,
                           eval_steps=2, timeout_s=240.0)  # fmt: skip
    return HeteroSetup(seq_length=128, batch=8, steps=120, local_steps=20, solo_steps=60, skip=3, warmup_steps=10,
                       eval_steps=8, timeout_s=600.0)  # fmt: skip


def arm_list(quick: bool) -> list[tuple[str, str]]:
    """(trio, arm) in the order they run."""
    return list(QUICK_ARMS) if quick else [(t, arm) for t in TRIOS for arm in ARMS if t in DIAGNOSTIC.get(arm, TRIOS)]


# ---------------------------------------------------------------- commands


def train_command(setup: HeteroSetup, model: Path, run_dir: Path, steps: int, extra: list[str]) -> list[str]:
    """One group's trainer: real text, byte tokenizer, float32, no compile, a metrics row every inner step."""
    return [
        sys.executable, "-m", "diloco.train", "--path-model", str(model), "--dataset", str(TINYSHAKESPEARE),
        "--seq-length", str(setup.seq_length), "--per-device-train-batch-size", str(setup.batch),
        "--total-batch-size", str(setup.batch), "--lr", "3e-3", "--warmup-steps", str(setup.warmup_steps),
        "--max-steps", str(steps), "--eval-steps", str(setup.eval_steps), "--log-interval", "1",
        "--precision", "32-true", "--no-torch-compile", "--metric-logger-type", "dummy", *extra,
        "--run-dir", str(run_dir),
    ]  # fmt: skip


def solo_steps(setup: HeteroSetup, cores: float) -> int:
    """Fewer steps for slower groups, so that the three solo runs take about as long."""
    return max(setup.skip + 3, round(setup.solo_steps * cores / max(CORES)))


def arm_flags(setup: HeteroSetup, trio: str, arm: str, rank: int, peers: list[str], run: str | None = None
              ) -> list[str]:  # fmt: skip
    """Swarm flags of group `rank` in `arm` on `trio`: H, the arm's own flags, the outer lr 1.0 / momentum 0."""
    # no evaluation until the end (the solo runs have none either): an evaluation costs the slowest group several
    # of its steps, which the throughput ratio would count as swarm overhead
    return [
        "--hv.galaxy-size", str(len(CORES)), "--hv.world-rank", str(rank), "--hv.local-steps", str(setup.local_steps),
        *ARM_FLAGS[arm], "--hv.outer-lr", "1.0", "--hv.outer-momentum", "0", "--hv.run-id", f"hetero-{run or f'{trio}-{arm}'}",
        "--hv.host-maddrs", "/ip4/127.0.0.1/tcp/0", "--hv.initial-peers", *peers,
    ]  # fmt: skip


# ---------------------------------------------------------------- running a phase


@dataclasses.dataclass(frozen=True)
class Launch:
    """One group's trainer in a phase: a label (its log's and cgroup's name), its share of a core, its command."""

    label: str
    cores: float
    command: list[str]
    run_dir: Path


def run_phase(
    launches: list[Launch], work_dir: Path, timeout_s: float, dht: CpuLimit | None = None,
    kill: tuple[int, int] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """Start every trainer in a cgroup of its own (and one without a quota for its helpers), set each quota once its
    trainer is past start-up (`engage_when_ready`), wait until all exit 0 (BenchError otherwise), then stop and remove
    everything. Returns, per launch, its cgroups, when its quota was set (unix time) and what the kernel counted from
    then on; and the sampler's series (`Sampler`; `dht`: the bootstrap DHT's cgroup, read beside them).
    `kill` (group, outer steps): that group's trainer is killed once it took as many outer steps (`kill_after`; its
    figures get ``killed_at``), and the others must exit 0."""
    with ExitStack() as stack:
        limits = [stack.enter_context(CpuLimit(x.label, x.cores, engaged=False)) for x in launches]
        helpers = [stack.enter_context(CpuLimit(f"{x.label}-helpers", usable_cores(), engaged=False)) for x in launches]
        jobs = []
        for launch, limit in zip(launches, limits):
            log_path = work_dir / f"{launch.label}.log"
            proc = started(stack, launch.command, log_path, procs.child_env())
            limit.add(proc.pid)  # before it imports torch: its DHT and averager processes come seconds later
            jobs.append((launch.label, proc, log_path))
        sampler = Sampler([proc.pid for _, proc, _ in jobs], limits, helpers, dht).start()
        stack.callback(sampler.stop)  # first on the way out: before the cgroups go
        deadline = time.monotonic() + timeout_s
        engaged = engage_when_ready(jobs, limits, helpers, [x.run_dir for x in launches], deadline)
        killed_at = None
        if kill is not None:
            killed_at = kill_after(jobs[kill[0]], launches[kill[0]].run_dir, kill[1], deadline)
            jobs = [job for i, job in enumerate(jobs) if i != kill[0]]
        wait_all(jobs, max(deadline - time.monotonic(), 1.0))
        sampler.stop()
        usage = [limit.usage() for limit in limits]
        helper_usage = [helper.usage() for helper in helpers]
    figures = [
        {"cgroup": str(limit.folder), "helpers_cgroup": str(helper.folder), "engaged_at": at,
         "cpu_s": None if u.cpu_s is None else u.cpu_s - before, "periods": u.periods,
         "throttled_periods": u.throttled_periods, "throttled_s": u.throttled_s, "helpers_cpu_s": h.cpu_s}
        for limit, helper, (at, before), u, h in zip(limits, helpers, engaged, usage, helper_usage)
    ]  # fmt: skip
    if kill is not None:
        figures[kill[0]]["killed_at"] = killed_at
    return figures, sampler.series


def kill_after(job: tuple[str, subprocess.Popen[bytes], Path], run_dir: Path, outer_steps: int,
               deadline: float) -> float:  # fmt: skip
    """`kill -9` of a group's trainer once its metrics show `outer_steps` outer steps (as when its machine dies: its
    DHT, averager and p2pd follow their parent). Returns when (unix time); BenchError if it exits or the deadline
    passes first."""
    name, proc, log_path = job
    while sum("outer_step" in row for row in read_rows(run_dir)) < outer_steps:
        if proc.poll() is not None:
            raise BenchError(f"{name} exited with code {proc.returncode} before it could be killed: "
                             f"{last_line(log_path)}")  # fmt: skip
        if time.monotonic() > deadline:
            raise BenchError(f"{name} took no {outer_steps} outer steps in time")
        time.sleep(ENGAGE_POLL_S * 10)
    proc.kill()
    killed_at = time.time()
    log.info("bench hetero: killed %s (kill -9) after its outer step %d", name, outer_steps)
    return killed_at


def engage_when_ready(
    jobs: list[tuple[str, subprocess.Popen[bytes], Path]],
    limits: list[CpuLimit],
    helpers: list[CpuLimit],
    run_dirs: list[Path],
    deadline: float,
) -> list[tuple[float, float]]:
    """Set each quota as soon as its trainer has created metrics.jsonl: torch imported, model built, swarm joined
    (DHT and averager running), no step trained; its helper processes move to its helpers' cgroup first. Start-up,
    which no figure counts, so runs at full speed instead of four times longer in the slowest group. The bench
    notices a ready trainer a moment late when start-ups load the machine (0.2 s was seen), so callers count only
    the steps that began after this. Returns per group (unix time, CPU seconds its cgroup had used until then)."""
    engaged: list[tuple[float, float] | None] = [None] * len(limits)
    while None in engaged:
        for i, ((name, proc, log_path), limit) in enumerate(zip(jobs, limits)):
            code = proc.poll()
            if code not in (None, 0):
                raise BenchError(f"{name} exited with code {code}: {last_line(log_path)}")
            if engaged[i] is None and ((run_dirs[i] / "metrics.jsonl").exists() or code is not None):
                for pid in limit.pids():
                    if pid != proc.pid:  # its DHT, p2pd and averager: a slow GPU, not a slow host
                        helpers[i].add(pid)
                limit.engage()
                engaged[i] = (time.time(), limit.usage().cpu_s or 0.0)
        if None in engaged and time.monotonic() > deadline:
            raise BenchError(f"{', '.join(n for (n, _, _), e in zip(jobs, engaged) if e is None)} did not start")
        time.sleep(ENGAGE_POLL_S)
    return [e for e in engaged if e is not None]


def start_dht(stack: ExitStack, work_dir: Path) -> tuple[list[str], CpuLimit]:
    """`diloco dht` on loopback in a cgroup without a quota (counted, not held), stopped when `stack` closes;
    returns its multiaddrs and that cgroup."""
    limit = stack.enter_context(CpuLimit("dht", usable_cores(), engaged=False))
    log_path = work_dir / "dht.log"
    command = [sys.executable, "-m", "diloco", "dht", "--identity", str(work_dir / "dht.pem"),
               "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]  # fmt: skip
    proc = started(stack, command, log_path, procs.child_env())
    limit.add(proc.pid)  # before it starts p2pd, which is born inside
    return dht_peers(proc, log_path), limit


# ---------------------------------------------------------------- reading a run


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_start(row: dict[str, Any], tokens_per_step: int) -> float:
    """When the inner step of a row (logged at its end, one row per step) began, in unix seconds."""
    return row["time"] - tokens_per_step / row["tokens_per_s"]


def moment(log_path: Path) -> str | None:
    """The inner AdamW moment a trainer says it took (galaxy or group), from its log."""
    found = MOMENT.search(log_path.read_text(errors="replace")) if log_path.exists() else None
    return found.group(1) if found else None


def harmonic_tokens_per_s(rows: list[dict[str, Any]]) -> float:
    """Tokens ÷ time over inner-step rows of equal tokens: the harmonic mean of their tokens_per_s."""
    return len(rows) / sum(1 / row["tokens_per_s"] for row in rows)


def solo_figures(
    launch: Launch, setup: HeteroSetup, engaged_at: float, counters: Counters | None = None, group: int = 0
) -> dict[str, Any]:
    """One group alone: tokens/s over its inner steps after the warm-up that began under the quota, and the CPU its
    training process used over them (`step_cpu`; `group`: its index in the sampler's series)."""
    inner = [row for row in read_rows(launch.run_dir) if "tokens_per_s" in row]
    measured = [row for row in inner[setup.skip :] if step_start(row, setup.tokens_per_step) >= engaged_at]
    if not measured:
        raise BenchError(f"{launch.label}: {len(inner)} inner steps, none after the warm-up and under the quota")
    spans = [(step_start(row, setup.tokens_per_step), row["time"]) for row in measured]
    return {
        "cores": launch.cores,
        "steps": len(inner),
        "steps_measured": len(measured),
        "tokens_per_s": harmonic_tokens_per_s(measured),
        **step_cpu(counters, group, spans),
    }


def rounds_of(rows: list[dict[str, Any]]) -> list[int]:
    """Inner steps this group trained before each outer step (rows in the order they were written)."""
    counts, count = [], 0
    for r in rows:
        if "tokens_per_s" in r:
            count += 1
        elif "outer_step" in r:
            counts.append(count)
            count = 0
    return counts


def group_figures(run_dir: Path, setup: HeteroSetup) -> dict[str, Any]:
    """One group in a swarm arm, from its metrics.jsonl and summary.json."""
    rows, done = read_rows(run_dir), summary(run_dir)
    inner = [row for row in rows if "tokens_per_s" in row]
    outer = [row for row in rows if "outer_step" in row]
    if not inner or not outer:
        raise BenchError(f"{run_dir}: {len(inner)} inner steps and {len(outer)} outer steps logged")
    waits = [row["wait_s"] for row in outer if "wait_s" in row]
    rounds = [row for row in outer if "num_peers" in row]  # a load without a round has no num_peers
    # a round that failed (num_peers 0) applied nothing: its tokens count again in the group's next round
    counted = [row["tokens"] for row in outer if "tokens" in row and row.get("num_peers") != 0]
    discarded = done.get("discarded_steps", sum(row.get("discarded_steps", 0) for row in outer))
    return {
        "steps": [(step_start(row, setup.tokens_per_step), setup.tokens_per_step / row["tokens_per_s"])
                  for row in inner],  # (unix start, seconds) of each inner step  # fmt: skip
        "eval_spans": [(before["time"], row["time"]) for before, row in zip(rows, rows[1:]) if "eval_loss" in row],
        "round_spans": [(row["time"] - row["averaging_s"], row["time"]) for row in rounds if "averaging_s" in row],
        "end": outer[-1]["time"],
        "inner_steps": len(inner),
        "tokens": len(inner) * setup.tokens_per_step,
        "tokens_counted_by_trainer": sum(counted) if counted else None,  # the outer rows' own `tokens`
        "outer_steps": outer[-1]["outer_step"],  # where it ended (a failed round's row adds none)
        "steps_per_round": rounds_of(rows),
        "num_peers": [row.get("num_peers") for row in outer],
        "outer_step_of_rows": [row["outer_step"] for row in outer],
        "rounds": len(rounds),
        "weights": [row.get("weight") for row in outer] if any("weight" in row for row in outer) else None,
        "wait_s": sum(waits) if waits else None,  # absent from trainers that do not log it
        "averaging_s": sum(row.get("averaging_s", 0.0) for row in outer),
        "discarded_steps": int(discarded),
        "discarded_tokens": int(done.get("discarded_tokens", sum(row.get("discarded_tokens", 0) for row in outer))),
        "carried_steps": int(sum(row.get("carried_steps", 0) for row in outer)),
        "loads": sum("loaded_state_from" in row for row in outer),
        "outer_digests": [row.get("outer_digest") for row in outer],
        "evals": [(row["time"], row["eval_loss"]) for row in rows if "eval_loss" in row],
        "losses": [(row["time"], row["loss"]) for row in inner],
        "final_eval_loss": done.get("final_eval_loss"),
        "params_sha256": done.get("params_sha256"),
        "summary_steps": done.get("steps"),
        "trainer_wall_s": done.get("wall_s"),
    }


# ---------------------------------------------------------------- the bench


def trio_launches(setup: HeteroSetup, model: Path, work_dir: Path, peers: list[str], trio: str, arm: str, name: str,
                  extra: dict[int, list[str]] | None = None) -> list[Launch]:  # fmt: skip
    """The groups of `trio` under `arm`'s flags, run `name` (its run id, and `work_dir / name` its folder), group i
    with the flags `extra[i]` besides."""
    return [Launch(f"{name}-{i}", cores, train_command(setup, model, work_dir / name / f"group-{i}", setup.steps,
                                                       [*arm_flags(setup, trio, arm, i, peers, name),
                                                        *(extra or {}).get(i, [])]),
                   work_dir / name / f"group-{i}") for i, cores in enumerate(TRIOS[trio])]  # fmt: skip


def dead_arm(setup: HeteroSetup, model: Path, work_dir: Path, peers: list[str],
             dht: CpuLimit) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """The equal trio under the `DEAD_ARM`'s flags, group `DEAD_GROUP` killed after its outer step `DEAD_AFTER`
    (`diloco.bench.hetero_dead`; the first in a quick run). Returns its figures and its commands."""
    name = "equal-tokens-dead"
    launches = trio_launches(setup, model, work_dir, peers, "equal", DEAD_ARM, name)
    log.info("bench hetero %s: %s", name, shlex.join(launches[-1].command))
    after = min(DEAD_AFTER, setup.steps // setup.local_steps // 2)  # (a quick run has 2 rounds)
    figures, _ = run_phase(launches, work_dir, setup.timeout_s, dht, kill=(DEAD_GROUP, after))
    survivors = [read_rows(x.run_dir) for i, x in enumerate(launches) if i != DEAD_GROUP]
    for i, launch in enumerate(launches):
        if i != DEAD_GROUP:
            summary(launch.run_dir)  # (BenchError unless it ended ok)
    dead = dead_figures(survivors, read_rows(launches[DEAD_GROUP].run_dir), figures[DEAD_GROUP]["killed_at"],
                        setup.tokens_per_step, after)  # fmt: skip
    return dead | {"flags": ARM_FLAGS[DEAD_ARM]}, [shlex.join(x.command) for x in launches]


def pause_arm(setup: HeteroSetup, model: Path, work_dir: Path, peers: list[str],
              dht: CpuLimit) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """The equal trio under the `PAUSE_ARM`'s flags, group `PAUSED_GROUP` evaluating after each of its rounds
    (`diloco.bench.hetero_pause`; the full run only). Returns its figures and its commands."""
    name = "equal-fixed-paused"
    evaluating = ["--eval-interval", str(setup.local_steps), "--eval-steps", str(PAUSE_EVAL_STEPS)]
    launches = trio_launches(setup, model, work_dir, peers, "equal", PAUSE_ARM, name, {PAUSED_GROUP: evaluating})
    log.info("bench hetero %s: %s", name, shlex.join(launches[PAUSED_GROUP].command))
    run_phase(launches, work_dir, setup.timeout_s, dht)
    rows = [read_rows(x.run_dir) for x in launches]
    paused = summary(launches[PAUSED_GROUP].run_dir)
    others = [r for i, r in enumerate(rows) if i != PAUSED_GROUP]
    figures = pause_figures(others, rows[PAUSED_GROUP], paused.get("eval_s") or [], len(launches))
    return figures | {"flags": ARM_FLAGS[PAUSE_ARM]}, [shlex.join(x.command) for x in launches]


def solo_launch(setup: HeteroSetup, model: Path, work_dir: Path, label: str, cores: float) -> Launch:
    """A group alone (galaxy size 1) at `cores`, for `solo_steps` inner steps, in the run folder named `label`."""
    run_dir = work_dir / label
    return Launch(label, cores, train_command(setup, model, run_dir, solo_steps(setup, cores), []), run_dir)


def solo_phase(setup: HeteroSetup, model: Path, work_dir: Path, quick: bool,
               tag: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:  # fmt: skip
    """Each group alone (in a quick run all three at once, a smoke test), run folders `tag`-i. Returns each group's
    solo figures, its cgroup figures and its command."""
    solo, cgroups, commands = [], [], []
    launches = [solo_launch(setup, model, work_dir, f"{tag}-{i}", cores) for i, cores in enumerate(CORES)]
    for phase in [launches] if quick else [[launch] for launch in launches]:
        for launch in phase:
            log.info("bench hetero %s (%g core): %s", launch.label, launch.cores, shlex.join(launch.command))
        figures, series = run_phase(phase, work_dir, setup.timeout_s)
        for i, (launch, cgroup) in enumerate(zip(phase, figures)):
            solo.append(solo_figures(launch, setup, cgroup["engaged_at"], Counters(series), i))
            cgroups.append(cgroup)
            commands.append(shlex.join(launch.command))
    return solo, cgroups, commands


def measure(quick: bool, work_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Solo, then each arm on each trio (`arm_list`; see the module's docstring), then (the full run) solo again:
    each arm's figures are taken against the mean of both solo runs (``hetero_solo.bracket``). Returns the result
    document."""
    setup = hetero_setup(quick)
    model = write_model(MODEL, work_dir / "models")
    cgroups: dict[str, list[dict[str, Any]]] = {}
    commands: dict[str, list[str]] = {}
    before, cgroups["solo"], commands["solo"] = solo_phase(setup, model, work_dir, quick, "solo")
    side_by_side: dict[str, list[dict[str, Any]]] = {}  # none in a quick run, whose solo phase is side by side
    for trio, cores in ({} if quick else TRIOS).items():
        phase = [solo_launch(setup, model, work_dir, f"side-{trio}-{i}", c) for i, c in enumerate(cores)]
        log.info("bench hetero solo side by side, %s: %s", trio, shlex.join(phase[0].command))
        figures, series = run_phase(phase, work_dir, setup.timeout_s)
        side_by_side[trio] = [solo_figures(launch, setup, cgroup["engaged_at"], Counters(series), i)
                              for i, (launch, cgroup) in enumerate(zip(phase, figures))]  # fmt: skip
        commands[f"side-{trio}"] = [shlex.join(launch.command) for launch in phase]
    ran = []  # each arm's (trio, name, groups, sampler's counters), its figures taken once solo is complete
    with ExitStack() as stack:
        peers, dht = start_dht(stack, work_dir)
        cgroups["dht"] = [{"cgroup": str(dht.folder)}]
        for trio, arm in arm_list(quick):
            name = f"{trio}-{arm}"
            launches = trio_launches(setup, model, work_dir, peers, trio, arm, name)
            log.info("bench hetero %s: %s", name, shlex.join(launches[-1].command))
            cgroups[name], series = run_phase(launches, work_dir, setup.timeout_s, dht)
            groups = [group_figures(x.run_dir, setup) | {"moment": moment(work_dir / f"{x.label}.log")}
                      for x in launches]  # fmt: skip
            ran.append((trio, arm, groups, Counters(series)))
            commands[name] = [shlex.join(x.command) for x in launches]
        dead, commands["equal-tokens-dead"] = dead_arm(setup, model, work_dir, peers, dht)
        pause = None
        if not quick:
            pause, commands["equal-fixed-paused"] = pause_arm(setup, model, work_dir, peers, dht)
    after = None
    if not quick:
        after, cgroups["solo-after"], commands["solo-after"] = solo_phase(setup, model, work_dir, quick, "solo-after")
    solo = bracket(before, after)
    arms = []
    for trio, arm, groups, counters in ran:
        alone = [next(s for s in solo if s["cores"] == c) for c in TRIOS[trio]]
        arms.append(arm_figures(arm, groups, cgroups[f"{trio}-{arm}"], alone, counters, trio, side_by_side.get(trio)))
    solo_sum = sum(s["tokens_per_s"] for s in solo)
    result = {
        "model": MODEL,
        "data": TINYSHAKESPEARE.name,
        "setup": dataclasses.asdict(setup) | {"tokens_per_step": setup.tokens_per_step,
                                               "target_tokens": setup.target_tokens},  # fmt: skip
        "cores": list(CORES),
        "trios": {trio: list(cores) for trio, cores in TRIOS.items()},
        "arm_flags": ARM_FLAGS,
        "solo": solo,
        "solo_before": before,
        "solo_after": after,
        "solo_sum_tokens_per_s": solo_sum,
        "side_by_side": side_by_side,
        "fixed_h_expected_ratio": len(CORES) * min(s["tokens_per_s"] for s in solo) / solo_sum,
        "arms": arms,
        "dead": dead,
        "pause": pause,
        "targets": targets(arms),
        "cgroups": cgroups,
        "commands": commands,
    }
    for line in explain(result):
        log.info("bench hetero: %s", line)
    return result

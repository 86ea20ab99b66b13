"""`diloco bench hetero`: three worker groups whose speeds really differ, each throttled by the kernel (a cgroup
CPU quota: `diloco.bench.throttle`), trained with a fixed H per group (today's mode) and with a swarm-wide token
budget (`--hv.target-tokens`), on real text.

Every group is one `python -m diloco.train` process (one rank) on loopback, in its own cgroup from its start;
nothing in the trainer sleeps. The quota is set once the trainer has created its metrics.jsonl (imports done,
model built, swarm joined, nothing trained): start-up, which no figure counts, would otherwise take four times
longer in the slowest group. Then its DHT, p2pd and averager processes leave the cgroup: the quota stands for a
slower accelerator, not a slower host, so it holds the training process only (those helpers took about 0.07 of a
core per group here, which inside a 0.2-core quota would be a third of the group's compute, a cost no GPU
box pays). Together the quotas hold 1.4 of the machine's 2 cores, leaving room for those helpers, the bootstrap
`diloco dht` (unthrottled) and the bench itself. Only steps that began after the quota was set count in a
tokens/s (the bench may notice a ready trainer a moment late). Three phases, one after another:

- solo: each group alone on the machine, one after the other (`--quick`: all three at once), as a galaxy of its
  own (galaxy size 1: no DHT, no averaging); tokens/s = its inner-step tokens ÷ inner-step time (the
  `tokens_per_s` rows after the warm-up, combined as a harmonic mean: a step the kernel parked counts with its
  full time);
- fixed-H: galaxy size 3, `--hv.local-steps H`, `--max-steps S`: every group trains S inner steps;
- target-tokens: `--hv.target-tokens H·3·(tokens per inner step)` and the same `--max-steps S` (the swarm
  trains 3·S steps' worth of tokens and ends at the same outer step count), so both arms sync about as often
  and see the same tokens.

An arm's wall time runs from the first inner step of any group to the last outer step of any group (metrics
rows carry unix times); its tokens/s (a group's, the swarm's) is the tokens of the steps that began once every
quota was set ÷ the wall time from then on, rounds included (the arms evaluate once, after the last round, as
the solo runs do not evaluate at all). Targets (issue 10) are
reported, never asserted: swarm ÷ the sum of solo tokens/s ≥ 0.9 in the token arm, and its final eval loss no
more than 1% above the fixed-H arm's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from diloco import procs
from diloco.bench import BenchError, machine_line
from diloco.bench.arms import row
from diloco.bench.models import write_model
from diloco.bench.throttle import CpuLimit
from diloco.bench.wire import dht_peers, last_line, started, summary, wait_all
from diloco.corpus import TINYSHAKESPEARE

__all__ = ["markdown", "measure", "plot"]

log = logging.getLogger("diloco")

# each group's share of a core, fastest first: 1.4 cores of quota on a 2-core machine leave room for what runs
# unthrottled beside them (the DHT bootstrap peer, this bench), so the arms measure waiting, not a full machine
CORES = (0.8, 0.4, 0.2)
MODEL = "llama-1m-bytes"  # in `bench.models`: holds the byte tokenizer's ids
ARMS = ("fixed-H", "target-tokens")
RATIO_TARGET = 0.9  # swarm tokens/s ÷ the sum of the groups' solo tokens/s, token arm
EVAL_GAP_TARGET = 0.01  # token arm's final eval loss at most 1% above the fixed-H arm's
ENGAGE_POLL_S = 0.02  # how often a starting trainer is looked at: its quota is set within this of being ready


@dataclasses.dataclass(frozen=True)
class HeteroSetup:
    """What every phase trains. Tokens per inner step = seq_length × batch (one rank per group)."""

    seq_length: int
    batch: int
    steps: int  # --max-steps of each arm: inner steps per group in fixed-H
    local_steps: int  # H
    solo_steps: int  # inner steps of the fastest group alone (slower ones: fewer, in proportion to their cores)
    skip: int  # warm-up rows left out of the solo tokens/s
    warmup_steps: int
    eval_steps: int  # held-out batches per evaluation
    matchmaking_s: float  # long enough for fixed-H's fast groups to wait for the slowest (else they go alone)
    timeout_s: float  # per phase, start-up included

    @property
    def tokens_per_step(self) -> int:
        return self.seq_length * self.batch

    @property
    def target_tokens(self) -> int:
        """Tokens the swarm trains between outer steps in the token arm: what fixed-H trains in one round."""
        return self.local_steps * len(CORES) * self.tokens_per_step


def hetero_setup(quick: bool) -> HeteroSetup:
    """Quick: 256 tokens per step, 2 rounds of H = 4. Full: 1024 tokens per step (the demo's), 6 rounds of 20."""
    if quick:
        return HeteroSetup(seq_length=64, batch=4, steps=8, local_steps=4, solo_steps=12, skip=2, warmup_steps=2,
                           eval_steps=2, matchmaking_s=30.0, timeout_s=240.0)  # fmt: skip
    return HeteroSetup(seq_length=128, batch=8, steps=120, local_steps=20, solo_steps=60, skip=3, warmup_steps=10,
                       eval_steps=4, matchmaking_s=60.0, timeout_s=600.0)  # fmt: skip


def token_arm_available() -> bool:
    """Whether this trainer has `--hv.target-tokens` (the child processes run the same code)."""
    from diloco.config import HvConfig

    return "target_tokens" in HvConfig.model_fields


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


def arm_flags(setup: HeteroSetup, arm: str, rank: int, peers: list[str]) -> list[str]:
    """Swarm flags of group `rank` in `arm`; the outer lr 1.0 / momentum 0 measured best for small H."""
    pace = (["--hv.local-steps", str(setup.local_steps)] if arm == "fixed-H"
            else ["--hv.target-tokens", str(setup.target_tokens)])  # fmt: skip
    # no evaluation until the end (the solo runs have none either): an evaluation costs the slowest group several
    # of its steps, which the throughput ratio would count as swarm overhead
    return [
        "--hv.galaxy-size", str(len(CORES)), "--hv.world-rank", str(rank),
        *pace, "--hv.outer-lr", "1.0", "--hv.outer-momentum", "0", "--hv.run-id", f"hetero-{arm}",
        "--hv.matchmaking-time", str(setup.matchmaking_s), "--hv.host-maddrs", "/ip4/127.0.0.1/tcp/0",
        "--hv.initial-peers", *peers,
    ]  # fmt: skip


# ---------------------------------------------------------------- running a phase


@dataclasses.dataclass(frozen=True)
class Launch:
    """One group's trainer in a phase: a label (its log's and cgroup's name), its share of a core, its command."""

    label: str
    cores: float
    command: list[str]
    run_dir: Path


def run_phase(launches: list[Launch], work_dir: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Start every trainer in a cgroup of its own, set each quota once its trainer is past start-up
    (`engage_when_ready`), wait until all exit 0 (BenchError otherwise), then stop and remove everything. Returns,
    per launch, its cgroup, when its quota was set (unix time) and what the kernel counted from then on."""
    with ExitStack() as stack:
        limits = [stack.enter_context(CpuLimit(x.label, x.cores, engaged=False)) for x in launches]
        jobs = []
        for launch, limit in zip(launches, limits):
            log_path = work_dir / f"{launch.label}.log"
            proc = started(stack, launch.command, log_path, procs.child_env())
            limit.add(proc.pid)  # before it imports torch: its DHT and averager processes come seconds later
            jobs.append((launch.label, proc, log_path))
        deadline = time.monotonic() + timeout_s
        engaged = engage_when_ready(jobs, limits, [x.run_dir for x in launches], deadline)
        wait_all(jobs, max(deadline - time.monotonic(), 1.0))
        usage = [limit.usage() for limit in limits]
    return [
        {"cgroup": str(limit.folder), "engaged_at": at, "cpu_s": None if u.cpu_s is None else u.cpu_s - before,
         "periods": u.periods, "throttled_periods": u.throttled_periods, "throttled_s": u.throttled_s}  # fmt: skip
        for limit, (at, before), u in zip(limits, engaged, usage)
    ]


def engage_when_ready(
    jobs: list[tuple[str, subprocess.Popen[bytes], Path]], limits: list[CpuLimit], run_dirs: list[Path], deadline: float
) -> list[tuple[float, float]]:
    """Set each quota as soon as its trainer has created metrics.jsonl: torch imported, model built, swarm joined
    (DHT and averager running), no step trained. Start-up, which no figure counts, so runs at full speed instead
    of four times longer in the slowest group. The bench notices a ready trainer a moment late when start-ups
    load the machine (0.2 s was seen), so callers count only the steps that began after this. Returns per group
    (unix time, CPU seconds its cgroup had used until then)."""
    engaged: list[tuple[float, float] | None] = [None] * len(limits)
    while None in engaged:
        for i, ((name, proc, log_path), limit) in enumerate(zip(jobs, limits)):
            code = proc.poll()
            if code not in (None, 0):
                raise BenchError(f"{name} exited with code {code}: {last_line(log_path)}")
            if engaged[i] is None and ((run_dirs[i] / "metrics.jsonl").exists() or code is not None):
                limit.release(proc.pid)  # its DHT, p2pd and averager: a slow GPU, not a slow host
                limit.engage()
                engaged[i] = (time.time(), limit.usage().cpu_s or 0.0)
        if None in engaged and time.monotonic() > deadline:
            raise BenchError(f"{', '.join(n for (n, _, _), e in zip(jobs, engaged) if e is None)} did not start")
        time.sleep(ENGAGE_POLL_S)
    return [e for e in engaged if e is not None]


def start_dht(stack: ExitStack, work_dir: Path) -> list[str]:
    """`diloco dht` on loopback, unthrottled (stopped when `stack` closes); returns its multiaddrs."""
    log_path = work_dir / "dht.log"
    command = [sys.executable, "-m", "diloco", "dht", "--identity", str(work_dir / "dht.pem"),
               "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]  # fmt: skip
    proc = started(stack, command, log_path, procs.child_env())
    return dht_peers(proc, log_path)


# ---------------------------------------------------------------- reading a run


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_start(row: dict[str, Any], tokens_per_step: int) -> float:
    """When the inner step of a row (logged at its end, one row per step) began, in unix seconds."""
    return row["time"] - tokens_per_step / row["tokens_per_s"]


def harmonic_tokens_per_s(rows: list[dict[str, Any]]) -> float:
    """Tokens ÷ time over inner-step rows of equal tokens: the harmonic mean of their tokens_per_s."""
    return len(rows) / sum(1 / row["tokens_per_s"] for row in rows)


def solo_figures(launch: Launch, setup: HeteroSetup, engaged_at: float) -> dict[str, Any]:
    """One group alone: tokens/s over its inner steps after the warm-up that began under the quota."""
    inner = [row for row in read_rows(launch.run_dir) if "tokens_per_s" in row]
    measured = [row for row in inner[setup.skip :] if step_start(row, setup.tokens_per_step) >= engaged_at]
    if not measured:
        raise BenchError(f"{launch.label}: {len(inner)} inner steps, none after the warm-up and under the quota")
    return {
        "cores": launch.cores,
        "steps": len(inner),
        "steps_measured": len(measured),
        "tokens_per_s": harmonic_tokens_per_s(measured),
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
    # a round that failed (num_peers 0) applied nothing: its tokens count again in the group's next round
    counted = [row["tokens"] for row in outer if "tokens" in row and row.get("num_peers") != 0]
    return {
        "steps": [(step_start(row, setup.tokens_per_step), setup.tokens_per_step / row["tokens_per_s"])
                  for row in inner],  # (unix start, seconds) of each inner step  # fmt: skip
        "eval_spans": [(before["time"], row["time"]) for before, row in zip(rows, rows[1:]) if "eval_loss" in row],
        "end": outer[-1]["time"],
        "inner_steps": len(inner),
        "tokens": len(inner) * setup.tokens_per_step,
        "tokens_counted_by_trainer": sum(counted) if counted else None,  # the outer rows' own `tokens`
        "outer_steps": outer[-1]["outer_step"],  # where it ended (a failed round's row adds none)
        "steps_per_round": rounds_of(rows),
        "num_peers": [row.get("num_peers") for row in outer],
        "weights": [row.get("weight") for row in outer] if any("weight" in row for row in outer) else None,
        "wait_s": sum(waits) if waits else None,  # absent from trainers that do not log it
        "averaging_s": sum(row.get("averaging_s", 0.0) for row in outer),
        "outer_digests": [row.get("outer_digest") for row in outer],
        "evals": [(row["time"], row["eval_loss"]) for row in rows if "eval_loss" in row],
        "losses": [(row["time"], row["loss"]) for row in inner],
        "final_eval_loss": done.get("final_eval_loss"),
        "params_sha256": done.get("params_sha256"),
        "summary_steps": done.get("steps"),
        "trainer_wall_s": done.get("wall_s"),
    }


def arm_figures(
    arm: str, groups: list[dict[str, Any]], cgroups: list[dict[str, Any]], solo: list[dict[str, Any]]
) -> dict[str, Any]:
    """An arm's swarm figures from its groups' (see `group_figures`) and the solo tokens/s.

    Its wall time runs from the first inner step of any group to the last outer step of any group. Throughput is
    measured over the part of it after every quota was set (`engage_when_ready`): the steps that began then.
    Where a group's time went: its step speed (its tokens ÷ the time inside its inner steps, the first step
    left out as warm-up; below solo when the machine or the group's own DHT and averager take CPU), and its
    evaluations (from the row before each eval row to it)."""
    start, end = min(g["steps"][0][0] for g in groups), max(g["end"] for g in groups)
    measured_from = max(start, *(c["engaged_at"] for c in cgroups))
    window, tokens_per_step = end - measured_from, groups[0]["tokens"] // groups[0]["inner_steps"]
    if window <= 0:
        raise BenchError(f"{arm}: no step began after every CPU quota was set")
    for g in groups:
        steps = g.pop("steps")
        g["measured_tokens"] = sum(t >= measured_from for t, _ in steps) * tokens_per_step
        g["tokens_per_s"] = g["measured_tokens"] / window
        steady = [seconds for t, seconds in steps[1:] if t >= measured_from] or [steps[0][1]]
        g["step_tokens_per_s"] = len(steady) * tokens_per_step / sum(steady)
        g["eval_s"] = sum(after - before for before, after in g.pop("eval_spans") if start <= before and after <= end)
        g["evals"] = [(t - start, loss) for t, loss in g.pop("evals")]  # seconds since the arm's first step
        g["losses"] = [(round(t - start, 3), loss) for t, loss in g.pop("losses")]
        del g["end"]
    measured = sum(g["measured_tokens"] for g in groups)
    shas = {g["params_sha256"] for g in groups}
    return {
        "name": arm,
        "wall_s": end - start,
        "unthrottled_start_s": measured_from - start,  # left out of the throughput: a quota was not set yet
        "swarm_tokens": sum(g["tokens"] for g in groups),
        "swarm_tokens_per_s": measured / window,
        "ratio_to_solo_sum": measured / window / sum(s["tokens_per_s"] for s in solo),
        "final_eval_loss": groups[0]["final_eval_loss"],
        "same_model": len(shas) == 1 and None not in shas,
        "groups": groups,
    }


# ---------------------------------------------------------------- the bench


def measure(quick: bool, work_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Solo (one group after the other; in a quick run all at once, a smoke test), then fixed-H, then
    target-tokens when this trainer has the flag (see the module's docstring). Returns the result document."""
    setup = hetero_setup(quick)
    model = write_model(MODEL, work_dir / "models")
    solo, cgroups, commands = [], {"solo": []}, {"solo": []}
    launches = [
        Launch(f"solo-{i}", cores, train_command(setup, model, work_dir / f"solo-{i}", solo_steps(setup, cores), []),
               work_dir / f"solo-{i}")
        for i, cores in enumerate(CORES)
    ]  # fmt: skip
    for phase in [launches] if quick else [[launch] for launch in launches]:
        for launch in phase:
            log.info("bench hetero %s (%g core): %s", launch.label, launch.cores, shlex.join(launch.command))
        for launch, cgroup in zip(phase, run_phase(phase, work_dir, setup.timeout_s)):
            solo.append(solo_figures(launch, setup, cgroup["engaged_at"]))
            cgroups["solo"].append(cgroup)
            commands["solo"].append(shlex.join(launch.command))
    arms, arm_names = [], ARMS if token_arm_available() else ARMS[:1]
    with ExitStack() as stack:
        peers = start_dht(stack, work_dir)
        for arm in arm_names:
            launches = [Launch(f"{arm}-{i}", cores, train_command(setup, model, work_dir / arm / f"group-{i}",
                                                                  setup.steps, arm_flags(setup, arm, i, peers)),
                               work_dir / arm / f"group-{i}") for i, cores in enumerate(CORES)]  # fmt: skip
            log.info("bench hetero %s: %s", arm, shlex.join(launches[-1].command))
            cgroups[arm] = run_phase(launches, work_dir, setup.timeout_s)
            groups = [group_figures(x.run_dir, setup) for x in launches]
            arms.append(arm_figures(arm, groups, cgroups[arm], solo))
            commands[arm] = [shlex.join(x.command) for x in launches]
    solo_sum = sum(s["tokens_per_s"] for s in solo)
    return {
        "model": MODEL,
        "data": TINYSHAKESPEARE.name,
        "setup": dataclasses.asdict(setup) | {"tokens_per_step": setup.tokens_per_step,
                                               "target_tokens": setup.target_tokens},  # fmt: skip
        "cores": list(CORES),
        "solo": solo,
        "solo_sum_tokens_per_s": solo_sum,
        "fixed_h_expected_ratio": len(CORES) * min(s["tokens_per_s"] for s in solo) / solo_sum,
        "arms": arms,
        "targets": targets(arms),
        "cgroups": cgroups,
        "commands": commands,
        "missing_arms": [arm for arm in ARMS if arm not in arm_names],
    }


def targets(arms: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's two targets, met or missed (None where the token arm did not run), and the token arm's tokens
    ÷ the fixed arm's (the eval losses compare at equal tokens only where that is about 1)."""
    by_name = {arm["name"]: arm for arm in arms}
    token, fixed = by_name.get("target-tokens"), by_name["fixed-H"]
    if token is None:
        return {"ratio": None, "ratio_met": None, "eval_gap": None, "eval_gap_met": None, "tokens_ratio": None,
                "ratio_target": RATIO_TARGET, "eval_gap_target": EVAL_GAP_TARGET}  # fmt: skip
    gap = token["final_eval_loss"] / fixed["final_eval_loss"] - 1
    return {
        "ratio": token["ratio_to_solo_sum"],
        "ratio_target": RATIO_TARGET,
        "ratio_met": token["ratio_to_solo_sum"] >= RATIO_TARGET,
        "eval_gap": gap,
        "eval_gap_target": EVAL_GAP_TARGET,
        "eval_gap_met": gap <= EVAL_GAP_TARGET,
        "tokens_ratio": token["swarm_tokens"] / fixed["swarm_tokens"],
    }


# ---------------------------------------------------------------- the report


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec)


def setup_lines(result: dict[str, Any]) -> list[str]:
    """Bullets: machine, command, what each phase ran."""
    s, load = result["setup"], f"{result['machine']['load_avg_1m']:.1f} / {result['load_avg_1m_end']:.1f}"
    cores = " / ".join(f"{c:g}" for c in result["cores"])
    lines = [
        f"- machine: {machine_line(result['machine'])}",
        f"- command: `{result['command']}`",
        f"- {len(result['cores'])} worker groups of 1 rank (`python -m diloco.train`) on loopback, each in a cgroup "
        f"v1 `cpu` of its own ({cores} of a core: `cpu.cfs_quota_us` ÷ `cpu.cfs_period_us`) holding its "
        "training process: a slower accelerator, not a slower host, so its DHT, p2pd and averager leave the "
        "cgroup when the quota is set, once the trainer has created metrics.jsonl (imports, model and swarm join "
        "at full speed; only steps that began after it are counted); the bootstrap `diloco dht` unthrottled",
        f"- model {result['model']}, {result['data']} with the byte tokenizer, {s['tokens_per_step']} tokens per "
        f"inner step (seq {s['seq_length']} × batch {s['batch']}), float32, one torch thread per process",
        f"- solo: each group alone, galaxy size 1 (no DHT), "
        f"{'all three at once (quick: a smoke test)' if result['quick'] else 'one after the other'}, {s['solo_steps']} "
        f"inner steps for the fastest and fewer for slower ones; tokens/s over the steps after {s['skip']} warm-up "
        "steps (harmonic mean of the rows' `tokens_per_s`)",
        f"- arms: `--max-steps {s['steps']}`; fixed-H `--hv.local-steps {s['local_steps']}`; target-tokens "
        f"`--hv.target-tokens {s['target_tokens']}` (H × groups × tokens per step); `--hv.matchmaking-time "
        f"{s['matchmaking_s']:g}`, outer lr 1.0, momentum 0, one eval of {s['eval_steps']} batches at the end "
        "(none during the run, as in the solo runs). Wall: from the arm's first inner step to its last outer step; "
        "tokens/s: the tokens of the steps that began once every quota was set ÷ the wall from then on (rounds "
        "included); step tokens/s: its tokens ÷ the time inside its inner steps (first step left out), below "
        "solo where other processes (the machine's, the group's own DHT and averager) took CPU; idle = the sum of "
        "the outer rows' `wait_s`; evals: from the row before each eval row to it",
        f"- 1-minute load average at start / end: {load}",
        "- the mixed-shape arm (a 1-rank and a 2-rank group, identical after every round, round time against two "
        "1-rank groups) is `diloco bench shapes`",
    ]
    if result["missing_arms"]:
        lines.append(f"- not run: {', '.join(result['missing_arms'])} (this trainer has no `--hv.target-tokens`)")
    return lines


def group_rows(result: dict[str, Any]) -> list[str]:
    """One table row per (arm, group)."""
    lines = []
    for arm in result["arms"]:
        for i, (g, solo, cg) in enumerate(zip(arm["groups"], result["solo"], result["cgroups"][arm["name"]])):
            rounds = g["steps_per_round"]
            throttled = f"{cg['throttled_periods']}/{cg['periods']}"
            cells = [arm["name"], str(i), f"{solo['cores']:g}", f"{solo['tokens_per_s']:.0f}",
                     f"{g['tokens_per_s']:.0f}", f"{g['tokens_per_s'] / solo['tokens_per_s']:.2f}",
                     f"{g['step_tokens_per_s']:.0f}", str(g["inner_steps"]), ", ".join(map(str, rounds)),
                     fmt(g["wait_s"]), f"{g['averaging_s']:.1f}", f"{g['eval_s']:.1f}", fmt(cg["cpu_s"]), throttled]
            lines.append(row(cells))  # fmt: skip
    return lines


def arm_rows(result: dict[str, Any]) -> list[str]:
    lines = []
    for arm in result["arms"]:
        lines.append(
            f"| {arm['name']} | {arm['wall_s']:.1f} | {arm['unthrottled_start_s']:.2f} | {arm['swarm_tokens']:,} | "
            f"{arm['swarm_tokens_per_s']:.0f} | "
            f"**{arm['ratio_to_solo_sum']:.2f}** | {fmt(arm['final_eval_loss'], '.4f')} | "
            f"{'yes' if arm['same_model'] else 'no'} |"
        )
    return lines


def verdict(result: dict[str, Any]) -> str:
    """The two targets, met or missed, and what fixed H is expected to reach."""
    t, expected = result["targets"], result["fixed_h_expected_ratio"]
    fixed = next(arm for arm in result["arms"] if arm["name"] == "fixed-H")
    words = [f"Fixed H: swarm ÷ sum of solo tokens/s {fixed['ratio_to_solo_sum']:.2f} (expected about "
             f"{len(result['cores'])} × slowest ÷ sum = {expected:.2f})."]  # fmt: skip
    if t["ratio"] is None:
        return " ".join([*words, "The token-budget targets were not measured (no target-tokens arm)."])
    met = {True: "met", False: "missed"}
    words.append(f"Token budget: {t['ratio']:.2f} (target ≥ {t['ratio_target']}: **{met[t['ratio_met']]}**);")
    words.append(f"final eval loss {t['eval_gap']:+.2%} against fixed H (target ≤ +{t['eval_gap_target']:.0%}: "
                 f"**{met[t['eval_gap_met']]}**), after {t['tokens_ratio']:.2f}× the fixed arm's tokens.")  # fmt: skip
    return " ".join(words)


def markdown(result: dict[str, Any]) -> str:
    """A dated section: setup, per-group and per-arm tables, the targets."""
    lines = [f"## {result['bench']}{' (quick)' if result['quick'] else ''}: {result['date']}", ""]
    lines += setup_lines(result)
    if "plot" in result:
        lines += ["", f"![training loss and tokens/s per group]({result['plot']})"]
    lines += [
        "",
        "| arm | group | cores | solo tokens/s | swarm tokens/s | swarm ÷ solo | step tokens/s in swarm | "
        "inner steps | steps per round | idle (s) | rounds (averaging_s, s) | evals (s) | CPU under quota (s) | "
        "throttled periods |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
        *group_rows(result),
        "",
        "| arm | wall (s) | before every quota (s) | swarm tokens | swarm tokens/s | ÷ sum of solo | final eval loss "
        "| same model |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
        *arm_rows(result),
        "",
        f"Sum of solo tokens/s: {result['solo_sum_tokens_per_s']:.0f}. {verdict(result)}",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], out: Path) -> Path:
    """hetero[-quick].png in `out`: group 0's training loss against seconds since each arm's first inner step (a
    moving average over 5 steps; the arms evaluate only at the end), and every group's tokens/s alone and in each
    arm."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    fig, (curve, bars) = plt.subplots(1, 2, figsize=(11, 4))
    for arm in result["arms"]:
        losses = arm["groups"][0]["losses"]
        windows = [[loss for _, loss in losses[max(0, i - 4) : i + 1]] for i in range(len(losses))]
        smooth = [sum(w) / len(w) for w in windows]
        curve.plot([t for t, _ in losses], smooth, label=f"{arm['name']} (final eval {arm['final_eval_loss']:.3f})")
    curve.set(xlabel="seconds since the arm's first inner step", ylabel="training loss, group 0", title="loss")
    curve.legend()
    series = [("solo", [s["tokens_per_s"] for s in result["solo"]])]
    series += [(arm["name"], [g["tokens_per_s"] for g in arm["groups"]]) for arm in result["arms"]]
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series):
        bars.bar([i + k * width for i in range(len(values))], values, width, label=name)
    bars.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(result["cores"]))])
    bars.set_xticklabels([f"group {i}\n{c:g} core" for i, c in enumerate(result["cores"])])
    bars.set(ylabel="tokens/s", title="tokens/s per group")
    bars.legend()
    fig.tight_layout()
    path = out / f"hetero{'-quick' if result['quick'] else ''}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

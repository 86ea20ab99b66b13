"""`diloco bench shapes`: worker groups of different shapes in one swarm, against groups of one shape.

Two arms, each a swarm of two worker groups on loopback (`--hv.transport tcp`) that train the same model on fake
data with the same total batch, H and number of steps:

- ``1+1``: two groups of one rank (``python -m diloco.train``);
- ``1+2``: a group of one rank and a 2-rank FULL_SHARD group (``torchrun --nproc_per_node 2``, half the batch per
  rank): each rank of it sends its shard's rows to their reducers, whichever group and rank reduces them.

Per arm: the rounds both groups took part in; whether the groups held the same model (``params_sha256``) and the
same outer state (``outer_digest``, which is shape-independent) after every such round and at the end; and per
round its time from the group's forming to the result (``averaging_s − wait_s``), the bytes the trainer counted,
and ``averaging_s``. The 1+2 arm runs three trainer processes on the machine where 1+1 runs two, so on a machine
with few cores its rounds compete for more CPU: the report gives the load, and the time ratio is what it is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from diloco import procs
from diloco.bench import BenchError, section_head
from diloco.bench.models import write_model
from diloco.bench.wire import dht_peers, started, summary, wait_all

__all__ = ["markdown", "measure"]

log = logging.getLogger("diloco")

ARMS = {"1+1": (1, 1), "1+2": (1, 2)}  # ranks of each group (the 2-rank group: FULL_SHARD)
# the pair under the pace flags of each arm, the 1-rank group accumulating two micro-batches where each rank of the
# other takes one (of unequal speed: which one is faster depends on the cores): the former defaults, and today's
PAIR_ARMS = {"1+2-old-defaults": ["--hv.pace", "fixed", "--hv.matchmaking-time", "5", "--hv.late-work", "drop"],
             "1+2-defaults": []}  # fmt: skip
QUICK_PAIR = ("1+2-defaults",)  # the quick run's pair: today's defaults (the full run compares the former ones)


@dataclasses.dataclass(frozen=True)
class ShapesSetup:
    """What both arms train: `batch` sequences per inner step per group (all its ranks), H = `local_steps`."""

    model: str
    seq_length: int
    batch: int
    steps: int
    local_steps: int
    matchmaking_s: float
    timeout_s: float


def shapes_setup(quick: bool) -> ShapesSetup:
    """Quick: the 0.26M model, 2 rounds. Full: the 14M one (56 MB of float32 per round), 6 rounds."""
    if quick:
        return ShapesSetup("llama-2m-fresh", seq_length=32, batch=2, steps=4, local_steps=2, matchmaking_s=30.0,
                           timeout_s=300.0)  # fmt: skip
    return ShapesSetup("llama-14m-fresh", seq_length=64, batch=4, steps=30, local_steps=5, matchmaking_s=30.0,
                       timeout_s=900.0)  # fmt: skip


def group_command(setup: ShapesSetup, model: Path, arm: str, world_rank: int, ranks: int, peers: list[str],
                  run_dir: Path) -> list[str]:  # fmt: skip
    """One group's trainer; a 2-rank group runs under torchrun, FULL_SHARD, half the batch per rank. In `ARMS` the
    pace is pinned (fixed H, a long rendezvous: every round has both); in `PAIR_ARMS` it is the arm's flags and every
    rank takes half the batch per micro-batch (the 1-rank group two of them)."""
    launcher = [sys.executable] if ranks == 1 else [
        str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={ranks}"]  # fmt: skip
    pace = PAIR_ARMS.get(arm, ["--hv.pace", "fixed", "--hv.matchmaking-time", str(setup.matchmaking_s)])
    micro = setup.batch // 2 if arm in PAIR_ARMS else setup.batch // ranks
    return [
        *launcher, "-m", "diloco.train", "--path-model", str(model), "--fake-data",
        "--seq-length", str(setup.seq_length), "--per-device-train-batch-size", str(micro),
        "--total-batch-size", str(setup.batch), "--max-steps", str(setup.steps), "--lr", "1e-3",
        "--warmup-steps", "1", "--precision", "32-true", "--no-torch-compile", "--metric-logger-type", "dummy",
        "--sharding-strategy", "FULL_SHARD", *pace, "--hv.local-steps", str(setup.local_steps),
        "--hv.galaxy-size", "2", "--hv.world-rank", str(world_rank),
        "--hv.run-id", f"shapes-{arm.replace('+', '-')}",  # (a run id is letters, digits, - and _)
        "--hv.host-maddrs", "/ip4/127.0.0.1/tcp/0", "--hv.initial-peers", *peers, "--run-dir", str(run_dir),
    ]  # fmt: skip


def outer_rows(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The rows of rounds this group averaged in, by outer step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["outer_step"]: row for row in rows if "bytes_sent" in row}


def arm_figures(name: str, run_dirs: list[Path]) -> dict[str, Any]:
    """Rounds both groups took part in, whether they were identical after each, and their times and bytes."""
    rows = [outer_rows(d) for d in run_dirs]
    finals = [summary(d) for d in run_dirs]
    shared = sorted(set.intersection(*({s for s, r in g.items() if r.get("num_peers") == 2} for g in rows)))
    if not shared:
        raise BenchError(f"{name}: no round had both groups ({', '.join(map(str, run_dirs))})")
    rounds = []
    for step in shared:
        both = [g[step] for g in rows]
        rounds.append({
            "outer_step": step,
            "allreduce_s": max(r["averaging_s"] - r["wait_s"] for r in both),  # the slower group's
            "averaging_s": [r["averaging_s"] for r in both],
            "mb": [(r["bytes_sent"] + r["bytes_received"]) / 1e6 for r in both],
            "identical": len({r["params_sha256"] for r in both}) == 1 and len({r["outer_digest"] for r in both}) == 1,
        })  # fmt: skip
    return {
        "name": name,
        "ranks": list(ARMS[name]),
        "rounds": rounds,
        "outer_steps": [f["outer_steps"] for f in finals],
        "identical_after_every_round": all(r["identical"] for r in rounds),
        "same_final_model": len({f["params_sha256"] for f in finals}) == 1,
        "median_allreduce_s": statistics.median(r["allreduce_s"] for r in rounds),
        "median_mb_per_group": statistics.median(mb for r in rounds for mb in r["mb"]),
    }


def pair_figures(name: str, run_dirs: list[Path], tokens_per_step: int) -> dict[str, Any]:
    """A `PAIR_ARMS` arm: per group its inner steps, steps per round, discarded steps, rounds and those with both
    groups, matchmaking waits and tokens/s (inside its steps, and over the arm's wall: rounds included); the
    swarm's tokens/s over the wall, and whether the groups ended on one model."""
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
            for d in run_dirs]  # fmt: skip
    finals = [summary(d) for d in run_dirs]
    inner = [[r for r in g if "tokens_per_s" in r] for g in rows]
    rounds = [[r for r in g if "num_peers" in r] for g in rows]  # a load without a round has no num_peers
    if not all(inner) or not all(rounds):
        raise BenchError(f"{name}: a group logged no inner step or no round ({', '.join(map(str, run_dirs))})")
    start = min(g[0]["time"] - tokens_per_step / g[0]["tokens_per_s"] for g in inner)
    wall = max(g[-1]["time"] for g in rows) - start
    groups = []
    for g, steps, outer, done in zip(rows, inner, rounds, finals):
        per_round, count = [], 0
        for r in g:
            count += "tokens_per_s" in r
            if "num_peers" in r:
                per_round, count = per_round + [count], 0
        groups.append({
            "inner_steps": len(steps), "steps_per_round": per_round, "discarded_steps": done.get("discarded_steps"),
            "rounds": len(outer), "full_rounds": sum(r["num_peers"] == 2 for r in outer),
            "wait_s": sum(r.get("wait_s", 0.0) for r in outer),
            "step_tokens_per_s": len(steps) / sum(1 / r["tokens_per_s"] for r in steps),
            "tokens_per_s": len(steps) * tokens_per_step / wall,
        })  # fmt: skip
    full, total = sum(g["full_rounds"] for g in groups), sum(g["rounds"] for g in groups)
    return {
        "name": name,
        "flags": PAIR_ARMS[name],
        "groups": groups,
        "wall_s": wall,
        "swarm_tokens_per_s": sum(g["tokens_per_s"] for g in groups),
        "full_round_share": full / total,
        "discarded_steps": sum(g["discarded_steps"] or 0 for g in groups),
        "same_final_model": len({f["params_sha256"] for f in finals}) == 1,
    }


def run_arm(work_dir: Path, name: str, launches: list[list[str]], timeout_s: float) -> None:
    """Start the arm's groups, wait until every one exited 0 (BenchError otherwise); all gone after."""
    with ExitStack() as arm_stack:
        jobs = []
        for i, command in enumerate(launches):
            log.info("bench shapes %s group %d: %s", name, i, shlex.join(command))
            log_path = work_dir / f"{name}-{i}.log"
            jobs.append((f"{name} group {i}", started(arm_stack, command, log_path, procs.child_env()), log_path))
        wait_all(jobs, timeout_s)


def measure(quick: bool, work_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Both arms, one after the other, against one bootstrap DHT peer. Returns the result document."""
    setup = shapes_setup(quick)
    model = write_model(setup.model, work_dir / "models")
    arms, commands = [], {}
    with ExitStack() as stack:
        dht_log = work_dir / "dht.log"
        dht = started(stack, [sys.executable, "-m", "diloco", "dht", "--identity", str(work_dir / "dht.pem"),
                              "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], dht_log, procs.child_env())  # fmt: skip
        peers = dht_peers(dht, dht_log)
        for name, shape in ARMS.items():
            run_dirs = [work_dir / name / f"group-{i}" for i in range(len(shape))]
            launches = [group_command(setup, model, name, i, ranks, peers, d)
                        for i, (ranks, d) in enumerate(zip(shape, run_dirs))]  # fmt: skip
            run_arm(work_dir, name, launches, setup.timeout_s)
            arms.append(arm_figures(name, run_dirs))
            commands[name] = [shlex.join(c) for c in launches]
        pair = []
        for name in QUICK_PAIR if quick else PAIR_ARMS:
            run_dirs = [work_dir / name / f"group-{i}" for i in range(2)]
            launches = [group_command(setup, model, name, i, ranks, peers, d)
                        for i, (ranks, d) in enumerate(zip(ARMS["1+2"], run_dirs))]  # fmt: skip
            run_arm(work_dir, name, launches, setup.timeout_s)
            pair.append(pair_figures(name, run_dirs, setup.batch * setup.seq_length))
            commands[name] = [shlex.join(c) for c in launches]
    equal, mixed = arms
    return {
        "setup": dataclasses.asdict(setup),
        "arms": arms,
        "pair": pair,
        "mixed_over_equal_round_time": mixed["median_allreduce_s"] / equal["median_allreduce_s"],
        "commands": commands,
    }


def markdown(result: dict[str, Any]) -> str:
    """A dated section: setup, one row per arm, and the mixed arm's round time against the equal one's."""
    s = result["setup"]
    lines = [
        *section_head(result),
        f"- 1-minute load average at start / end: {result['machine']['load_avg_1m']:.1f} / "
        f"{result['load_avg_1m_end']:.1f}",
        f"- model {s['model']}, fake data, seq {s['seq_length']}, {s['batch']} sequences per inner step per group, "
        f"`--max-steps {s['steps']} --hv.local-steps {s['local_steps']}`, `--hv.transport tcp`, no compression, "
        "float32, one torch thread per process; the 2-rank group is FULL_SHARD under torchrun",
        "- round time: from the round's group forming to the result (`averaging_s − wait_s`, the slower group's), "
        "median over the rounds both groups took part in; MB: what the trainer counted, sent + received, per group "
        "(all its ranks) and round",
        "",
        "| arm | ranks per group | shared rounds | identical after every round | same final model | round time, "
        "median (s) | MB per group and round |",
        "|---|---|---:|---|---|---:|---:|",
    ]
    for arm in result["arms"]:
        lines.append(
            f"| {arm['name']} | {' + '.join(map(str, arm['ranks']))} | {len(arm['rounds'])} | "
            f"{'yes' if arm['identical_after_every_round'] else '**no**'} | "
            f"{'yes' if arm['same_final_model'] else '**no**'} | {arm['median_allreduce_s']:.3f} | "
            f"{arm['median_mb_per_group']:.2f} |"
        )
    lines += ["", f"Round time of 1+2 ÷ 1+1: {result['mixed_over_equal_round_time']:.2f}.", *pair_lines(result)]
    return "\n".join(lines) + "\n"


def pair_lines(result: dict[str, Any]) -> list[str]:
    """The pair under each pace: one row per group, then the swarm's."""
    if not result.get("pair"):
        return []
    old = "1+2-old-defaults"
    paces = (f"the former defaults (`{' '.join(PAIR_ARMS[old])}`) and today's"
             if old in {arm["name"] for arm in result["pair"]} else "today's defaults")  # fmt: skip
    lines = [
        "",
        "**Unequal speed, one swarm**: the same 1-rank and 2-rank groups, every rank taking half the batch per "
        f"micro-batch (the 1-rank group two in a row, in one process), under {paces} (no pace flag). Tokens/s: in its "
        "steps, and its tokens over the arm's wall (rounds and waits included); full rounds: those with both groups.",
        "",
        "| arm | group | ranks | inner steps | steps per round | discarded steps | full rounds | waits (s) | "
        "tokens/s in steps | tokens/s over the wall |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for arm in result["pair"]:
        for i, g in enumerate(arm["groups"]):
            lines.append(
                f"| {arm['name']} | {i} | {ARMS['1+2'][i]} | {g['inner_steps']} | "
                f"{', '.join(map(str, g['steps_per_round']))} | {g['discarded_steps']} | "
                f"{g['full_rounds']}/{g['rounds']} | {g['wait_s']:.1f} | {g['step_tokens_per_s']:.0f} | "
                f"{g['tokens_per_s']:.0f} |"
            )
    lines.append("")
    for arm in result["pair"]:
        lines.append(
            f"- {arm['name']}: {arm['swarm_tokens_per_s']:.0f} tokens/s over {arm['wall_s']:.0f} s, "
            f"{arm['full_round_share']:.0%} of the rounds with both groups, {arm['discarded_steps']} inner steps "
            f"discarded, one final model: {'yes' if arm['same_final_model'] else '**no**'}"
        )
    return lines

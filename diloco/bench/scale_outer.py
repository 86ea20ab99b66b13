"""`diloco bench scale`'s outer part: the DiLoCo path at the size of a real model.

Two 1-rank groups of `OuterSetup.model` (fresh, float32, seq 64, one sequence per step) train rounds at H = 2
against a bootstrap peer on loopback (galaxy size 3, the default pace and matchmaking); once the first of them took
its first round, a third group starts (their training paused until it has joined) and downloads the swarm's state,
then trains the remaining rounds with them.
Group 0 writes a checkpoint at its last step, and a run of galaxy size 1 resumes from it (and takes no step).

Per group: peak RSS (the trainer's own ``ru_maxrss``: the whole run, its export of ``final/`` included) ÷ what a group
must hold, 6 × the float32 parameters (the parameters, their gradients, AdamW's two moments, the outer copy and the
outer momentum), against `HELD_TARGET`. Per GB of parameters: the median seconds of a round's digest of the outer
state, exchange (``averaging_s``, from the round's start) and outer step (pseudo-gradient + apply), of the late
joiner's state download, and of a checkpoint's save and load.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from diloco import procs
from diloco.bench import BenchError
from diloco.bench.models import write_model
from diloco.bench.wire import (
    count_parameters,
    dht_peers,
    outer_rows,
    started,
    summary,
    wait_all,
)

HELD_TARGET = 1.25  # a group's peak RSS ÷ 6 × its float32 parameters
HELD_COPIES = 6  # parameters, gradients, AdamW's exp_avg and exp_avg_sq, the outer copy, the outer momentum
GROUPS, LOCAL_STEPS, POLL_S = 3, 2, 0.5


@dataclasses.dataclass(frozen=True)
class OuterSetup:
    model: str
    steps: int  # inner steps of each group (rounds: steps / LOCAL_STEPS); the late one starts after the first round
    timeout_s: float
    # --hv.averaging-timeout: also how long the first two groups wait at the start for the third, which starts late
    averaging_timeout: str


def outer_setup(quick: bool) -> OuterSetup:
    """Quick: a 0.26M model, 10 rounds. Full: a 207M model (three groups of it fit in 24 GB, of 300M would not), 6
    rounds."""
    if quick:
        return OuterSetup(model="llama-2m-fresh", steps=20, timeout_s=300.0,
                          averaging_timeout="15")  # fmt: skip
    return OuterSetup(model="llama-200m-fresh", steps=12, timeout_s=1800.0,
                      averaging_timeout="auto")  # fmt: skip


def group_command(setup: OuterSetup, model: Path, rank: int, peers: list[str], run_dir: Path,
                  *extra: str) -> list[str]:  # fmt: skip
    # the default pace and matchmaking (a checkpoint's seconds made group 0 late to fixed-H rounds of 5 s)
    swarm = ["--hv.galaxy-size", str(GROUPS), "--hv.world-rank", str(rank), "--hv.local-steps", str(LOCAL_STEPS),
             "--hv.averaging-timeout", setup.averaging_timeout,
             "--hv.run-id", "scale-outer", "--hv.host-maddrs", "/ip4/127.0.0.1/tcp/0", "--hv.initial-peers", *peers]
    return [*train_command(setup, model, run_dir), *swarm, *extra]  # fmt: skip


def train_command(setup: OuterSetup, model: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "diloco.train", "--path-model", str(model), "--fake-data", "--seq-length", "64",
            "--per-device-train-batch-size", "1", "--total-batch-size", "1", "--max-steps", str(setup.steps),
            "--eval-steps", "1", "--precision", "32-true", "--no-torch-compile", "--metric-logger-type", "dummy",
            "--run-dir", str(run_dir)]  # fmt: skip


def wait_for_round(run_dir: Path, proc: Any, log_path: Path, timeout_s: float) -> None:
    """Until group `run_dir` logged its first round (with or without a peer)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and outer_rows(run_dir):
            return
        if proc.poll() is not None:
            raise BenchError(f"{run_dir.name} exited with code {proc.returncode} before its first round ({log_path})")
        time.sleep(POLL_S)
    raise BenchError(f"{run_dir.name} took no round within {timeout_s:.0f} s ({log_path})")


def hold_until_joined(held: list[Any], proc: Any, log_path: Path, timeout_s: float) -> None:
    """Pause the training of `held` (SIGSTOP; their DHT peers go on) until the late group logging to `log_path` has
    joined the swarm, so that they are still training when it looks for the state (a new interpreter takes seconds,
    in which a small model's groups could end their run)."""
    for group in held:
        os.kill(group.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout_s
        while "joined the swarm" not in log_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"the late group did not join the swarm ({log_path})")
            time.sleep(POLL_S)
    finally:
        for group in held:
            os.kill(group.pid, signal.SIGCONT)


def swarm_runs(setup: OuterSetup, model: Path, work_dir: Path) -> list[Path]:
    """The three groups (the third late) against a bootstrap peer; their run folders."""
    dirs = [work_dir / f"group-{i}" for i in range(GROUPS)]
    logs = [work_dir / f"group-{i}.log" for i in range(GROUPS)]
    with ExitStack() as stack:
        dht_log = work_dir / "dht.log"
        dht = started(stack, [sys.executable, "-m", "diloco", "dht", "--identity", str(work_dir / "dht.pem"),
                              "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], dht_log, procs.child_env())  # fmt: skip
        peers = dht_peers(dht, dht_log)
        # at its last step only: a save of a real model's state takes seconds (8 s here at 207M), and a group that
        # checkpoints before a round comes late to it
        checkpoints = ["--ckpt.interval", str(setup.steps), "--ckpt.path", str(work_dir / "checkpoints")]
        commands = [group_command(setup, model, i, peers, dirs[i], *(checkpoints if i == 0 else ()))
                    for i in range(GROUPS)]  # fmt: skip
        jobs = [(f"group {i}", started(stack, commands[i], logs[i], procs.child_env()), logs[i]) for i in (0, 1)]
        wait_for_round(dirs[0], jobs[0][1], logs[0], setup.timeout_s)
        jobs.append(("group 2 (late)", started(stack, commands[2], logs[2], procs.child_env()), logs[2]))
        hold_until_joined([proc for _, proc, _ in jobs[:2]], jobs[2][1], logs[2], setup.timeout_s)
        wait_all(jobs, setup.timeout_s)
    return dirs


def resume_run(setup: OuterSetup, model: Path, work_dir: Path) -> dict[str, Any]:
    """Galaxy size 1, resumed from group 0's last checkpoint, no step taken: its load's seconds."""
    folders = sorted((work_dir / "checkpoints").glob("step-*"), key=lambda f: int(f.name.split("-")[1]))
    if not folders:
        raise BenchError(f"group 0 wrote no checkpoint in {work_dir / 'checkpoints'}")
    run_dir, log_path = work_dir / "resumed", work_dir / "resumed.log"
    command = [*train_command(setup, model, run_dir), "--ckpt.resume", str(folders[-1])]
    with ExitStack() as stack:
        wait_all([("resumed", started(stack, command, log_path, procs.child_env()), log_path)], setup.timeout_s)
    return {"resume_s": summary(run_dir)["resume_s"], "checkpoint": str(folders[-1]), "command": shlex.join(command)}


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def group_figures(run_dir: Path, params: int) -> dict[str, Any]:
    done = summary(run_dir)
    rows = outer_rows(run_dir)
    rounds = [r for r in rows if r.get("num_peers", 0) >= 2]
    joined = done.get("state_downloads") or []  # every download, the one at the join included
    peak = max(done["peak_memory_mb_per_rank"])
    return {
        "peak_rss_mb": peak,
        "held_ratio": peak / (HELD_COPIES * 4 * params / 1e6),
        "rounds": len(rounds),
        "digest_s": median([r["digest_s"] for r in rounds]),
        "exchange_s": median([r["averaging_s"] for r in rounds]),
        "outer_step_s": median([r["pseudo_gradient_s"] + r["outer_apply_s"] for r in rounds]),
        "download_s": joined[0]["download_s"] if joined else None,
        "download_mb": joined[0]["download_mb"] if joined else None,
        "checkpoint_s": median(done.get("checkpoint_s") or []),
    }


def measure_outer(quick: bool, work_dir: Path) -> dict[str, Any]:
    setup = outer_setup(quick)
    work_dir.mkdir(parents=True, exist_ok=True)
    model = write_model(setup.model, work_dir / "models")
    params = count_parameters(model)
    began = time.monotonic()
    dirs = swarm_runs(setup, model, work_dir)
    groups = [group_figures(d, params) for d in dirs]
    resumed = resume_run(setup, model, work_dir)
    gb = 4 * params / 1e9
    if groups[2]["download_s"] is None:
        raise BenchError(f"the late group downloaded no state (see {dirs[2]})")
    per_gb = {
        "digest_s": median([g["digest_s"] for g in groups if g["digest_s"] is not None]),
        "exchange_s": median([g["exchange_s"] for g in groups if g["exchange_s"] is not None]),
        "outer_step_s": median([g["outer_step_s"] for g in groups if g["outer_step_s"] is not None]),
        "download_s": groups[2]["download_s"],
        "checkpoint_save_s": groups[0]["checkpoint_s"],
        "checkpoint_load_s": resumed["resume_s"],
    }
    return {
        "setup": dataclasses.asdict(setup),
        "params": params,
        "float32_gb": gb,
        "groups": groups,
        "resumed": resumed,
        "seconds": per_gb,
        "seconds_per_gb": {k: (v / gb if v is not None else None) for k, v in per_gb.items()},
        "held_met": max(g["held_ratio"] for g in groups) <= HELD_TARGET,
        "wall_s": time.monotonic() - began,
    }


def markdown_lines(result: dict[str, Any]) -> list[str]:
    met = {True: "**met**", False: "**missed**"}
    s = result["setup"]
    lines = [
        "",
        f"The outer path: {s['model']} ({result['params'] / 1e6:,.0f}M parameters, {result['float32_gb']:.2f} GB in "
        f"float32), three 1-rank groups on loopback (galaxy size 3, H = {LOCAL_STEPS}, seq 64, one sequence per step, "
        f"{s['steps']} inner steps each), the third started after the first round; group 0 checkpoints at its last "
        "step, "
        f"and a run of galaxy size 1 resumes from its last checkpoint ({result['wall_s']:.0f} s in all).",
        "",
        "| group | rounds with peers | peak RSS (MB) | ÷ 6 × parameters |",
        "|---|---:|---:|---:|",
    ]
    for i, g in enumerate(result["groups"]):
        lines.append(f"| {i}{' (late)' if i == 2 else ''} | {g['rounds']} | {g['peak_rss_mb']:,.0f} | "
                     f"{g['held_ratio']:.2f} |")  # fmt: skip
    names = {"digest_s": "a round's digest of the outer state", "exchange_s": "a round's exchange (averaging_s)",
             "outer_step_s": "the outer step (pseudo-gradient + apply)", "download_s": "the late group's download "
             f"({result['groups'][2]['download_mb']:,.0f} MB)", "checkpoint_save_s": "a checkpoint's save",
             "checkpoint_load_s": "a checkpoint's load (resume)"}  # fmt: skip
    lines += ["", "| seconds of | median (s) | per GB of parameters (s) |", "|---|---:|---:|"]
    for key, name in names.items():
        value, per_gb = result["seconds"][key], result["seconds_per_gb"][key]
        lines.append(f"| {name} | {value:.2f} | {per_gb:.2f} |" if value is not None else f"| {name} | – | – |")
    worst = max(g["held_ratio"] for g in result["groups"])
    lines += ["", f"- peak RSS ÷ what a group must hold: at most {worst:.2f}; target ≤ {HELD_TARGET}: "
              f"{met[result['held_met']]}"]  # fmt: skip
    return lines

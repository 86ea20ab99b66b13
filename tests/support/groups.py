"""Worker groups as processes of the test, for the multi-group scenarios (faults, a private swarm): one group's
flags against a bootstrap peer, starting it with its output in a log, waiting for groups to end, their outer rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.paths import ROOT, TORCHRUN
from tests.support.procs import FAST, child_env
from tests.support.swarm import kill_group

SWARM = [*FAST, "--fake-data", "--total-batch-size", "2", "--log-interval", "10", "--hv.local-steps", "5",
         "--hv.pace", "fixed", "--hv.matchmaking-time", "3", "--hv.averaging-timeout", "15"]  # fmt: skip


def group_args(world_rank: int, galaxy: int, peers: list[str], run_dir: Path, *extra: str) -> list[str]:
    return [*SWARM, "--hv.galaxy-size", str(galaxy), "--hv.world-rank", str(world_rank),
            "--hv.initial-peers", *peers, "--run-dir", str(run_dir), *extra]  # fmt: skip


def start_group(args: list[str], log: Path, torchrun: bool = False, ranks: int = 1,
                module: str = "diloco.train") -> subprocess.Popen[str]:  # fmt: skip
    """One worker group in its own session, output to `log` (a pipe nobody reads would block it). `module`:
    `tests.support.runs` for several runs one after another (`args`: its RUNS.json)."""
    entry = [str(TORCHRUN), "--standalone", f"--nproc_per_node={ranks}"] if torchrun else [sys.executable]
    with log.open("a") as out:
        return subprocess.Popen(
            [*entry, "-m", module, *args], cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip


def renice_threads(pid: int, niceness: int) -> None:
    """Every thread of process `pid` (not its child processes) at `niceness`: a group's training process can yield
    the CPU to others (19) while its heartbeat keeps its status record fresh and its DHT peer and p2pd, which are
    child processes, answer at their own priority. Threads it starts later inherit it."""
    tasks = Path("/proc") / str(pid) / "task"
    for task in tasks.iterdir() if tasks.exists() else ():  # (a process that ended: the caller's checks say so)
        try:
            os.setpriority(os.PRIO_PROCESS, int(task.name), niceness)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def finish(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for proc, log in zip(procs, logs):
            remaining = max(deadline - time.monotonic(), 1)
            assert proc.wait(timeout=remaining) == 0, log.read_text()[-3000:]
    finally:
        for proc in procs:
            kill_group(proc)


def outer_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [row for row in rows if "outer_step" in row]

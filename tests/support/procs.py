"""Real processes for the tests: the environment they start with, running them (killing their whole process group
on a timeout), reading their output, and the trainer's entry points with small, fast defaults."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from diloco import procs
from tests.support.paths import ROOT, TINY_MODEL, TORCHRUN

# Small, fast defaults every trainer test starts from (flags win when repeated later on the line).
FAST = [
    "--path-model", str(TINY_MODEL), "--seq-length", "32", "--per-device-train-batch-size", "2",
    "--lr", "1e-2", "--warmup-steps", "2", "--no-torch-compile", "--precision", "32-true",
]  # fmt: skip


def child_env() -> dict[str, str]:
    """One torch thread per process (the 2 cores are shared by every process a test starts); wandb and the Hugging
    Face hub offline (a test never downloads: hub ids resolve in a cache the test builds, or fail at once)."""
    return procs.child_env(threads=1, WANDB_MODE="offline", HF_HUB_OFFLINE="1")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_cmd(
    cmd: list[str], timeout: float = 180, cwd: Path = ROOT, env: dict[str, str] | None = None, term_grace_s: float = 0
) -> Result:
    """Run in a new process group; on timeout kill the whole group (torchrun and its ranks). `env`: variables to
    set besides `child_env()`'s. `term_grace_s` > 0: on timeout, SIGTERM the group first and give it that long to
    clean up (a bench removes its namespaces and stops processes in sessions of their own, which a SIGKILL to its
    group would leave running)."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=child_env() | (env or {}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = stop_group(proc, term_grace_s)
        raise AssertionError(f"{' '.join(cmd)} timed out after {timeout}s\n{out}\n{err}") from None
    return Result(proc.returncode, out, err)


def run_and_resume(tmp_path: Path, common: list[str], at: int) -> tuple[Path, Path]:
    """`python -m diloco.train` with `common` twice in the same two torchrun ranks (``tests.support.runs``): straight
    through with a checkpoint at step `at`, then resumed from that checkpoint. Returns the two run folders (straight,
    resumed) once both ended with exit code 0."""
    straight, again = tmp_path / "straight", tmp_path / "resumed"
    saved = straight / "checkpoints" / f"step-{at}"
    runs = [[*common, "--ckpt.interval", str(at), "--run-dir", str(straight)],
            [*common, "--ckpt.resume", str(saved), "--run-dir", str(again)]]  # fmt: skip
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    result = run_cmd([str(TORCHRUN), "--standalone", "--nproc_per_node=2", "-m", "tests.support.runs",
                      str(tmp_path / "runs.json")], timeout=300)  # fmt: skip
    assert result.returncode == 0, result.output[-3000:]
    return straight, again


def stop_group(proc: subprocess.Popen[str], term_grace_s: float) -> tuple[str, str]:
    """End `proc`'s process group (it leads a session of its own) and return its output: SIGTERM and up to
    `term_grace_s` seconds to exit (when > 0), then SIGKILL to whatever of the group is left."""
    out = err = None
    if term_grace_s > 0:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            out, err = proc.communicate(timeout=term_grace_s)
    with contextlib.suppress(ProcessLookupError):  # gone already: it exited within the grace
        os.killpg(proc.pid, signal.SIGKILL)
    if out is None:
        out, err = proc.communicate()
    return out, err


def torchrun(args: list[str], nproc: int = 2, timeout: float = 180, extra: list[str] | None = None) -> Result:
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", *(extra or []), "-m", "diloco.train", *args]
    return run_cmd(cmd, timeout)


def python_train(
    args: list[str], timeout: float = 120, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> Result:
    return run_cmd([sys.executable, "-m", "diloco.train", *args], timeout, cwd, env)


def read_until(proc: subprocess.Popen[str], pattern: str, timeout: float = 60) -> re.Match[str]:
    """Read `proc`'s stdout line by line until one matches `pattern`; on failure the assertion shows what it said
    (its stderr too, when that is a pipe of its own and it has exited)."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if match := re.search(pattern, line):
            return match
    stderr = proc.stderr.read() if proc.stderr is not None and proc.poll() is not None else ""
    raise AssertionError(f"no {pattern!r} in output:\n{''.join(seen)}{stderr}")


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_ok(result: Result) -> None:
    """Exit code 0; else the output's tail, after the one-line errors of any rank (a groupmate's traceback that
    followed would push them out of the tail)."""
    errors = [line for line in result.output.splitlines() if re.match(r"(\[rank\d+\]: )?error: ", line)]
    assert result.returncode == 0, "\n".join([*errors[:10], result.output[-4000:]])

"""Benchmark arms that run the real trainer as subprocesses (strategies, overhead) and the table they share.

Every figure comes from a run's metrics.jsonl, or from sampling the run's process tree.
"""

from __future__ import annotations

import json
import logging
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from diloco import procs
from diloco.bench import BenchError, section_head
from diloco.bench.models import model_folder

log = logging.getLogger("diloco")

SAMPLE_S = 0.2  # how often the process tree's RSS is sampled
ARM_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Workload:
    """What every arm of one bench trains. Tokens per inner step = seq_length × total_batch_size."""

    model: str | Path  # a model folder, or the name of one of `bench.models` (see `written`)
    seq_length: int
    per_device_batch: int
    total_batch: int
    steps: int  # inner steps per run
    skip: int  # warm-up steps left out of the median

    def written(self, folder: Path) -> Workload:
        """This workload with its model as a folder: a named model's config is written into `folder` first."""
        return replace(self, model=model_folder(self.model, folder))

    def flags(self) -> list[str]:
        assert isinstance(self.model, Path), "the trainer needs a model folder: call `written` first"
        return [
            "--path-model", str(self.model), "--fake-data", "--seq-length", str(self.seq_length),
            "--per-device-train-batch-size", str(self.per_device_batch), "--total-batch-size", str(self.total_batch),
            "--max-steps", str(self.steps), "--warmup-steps", "2", "--eval-steps", "1", "--log-interval", "1",
            "--no-torch-compile", "--precision", "32-true", "--metric-logger-type", "dummy",
        ]  # fmt: skip


@dataclass(frozen=True)
class Arm:
    """One configuration: extra train flags, ranks, and a remark for the table."""

    name: str
    flags: tuple[str, ...]
    nproc: int
    note: str = ""
    deepspeed: str = ""  # the DeepSpeed ZeRO setting it corresponds to ("stage 2"), when there is one


@dataclass
class Measured:
    """One arm's run. tokens_per_s: median over the measured steps (all ranks together); peak_memory_mb: rank
    0's peak RSS on CPU (peak allocated accelerator memory on GPU), from metrics.jsonl; rank_peak_mb and
    rank_reserved_mb: every rank's peak (and on a GPU its allocator's peak reserve), from summary.json;
    tree_peak_rss_mb: the largest summed RSS of the whole process tree (launcher, ranks, DHT/averager children),
    sampled every SAMPLE_S seconds, so a lower bound."""

    name: str
    command: str
    tokens_per_s: float
    tokens_per_s_iqr: tuple[float, float]
    steps_measured: int
    peak_memory_mb: float
    tree_peak_rss_mb: float
    wall_s: float
    note: str = ""
    step_tokens_per_s: list[float] = field(default_factory=list)
    deepspeed: str = ""
    rank_peak_mb: list[float] = field(default_factory=list)
    rank_reserved_mb: list[float] | None = None


# ---------------------------------------------------------------- running one arm


def arm_command(arm: Arm, workload: Workload, run_dir: Path) -> list[str]:
    """The exact trainer command line of one arm."""
    train = ["-m", "diloco.train", *workload.flags(), *arm.flags, "--run-dir", str(run_dir)]
    if arm.nproc == 1:
        return [sys.executable, *train]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    return [torchrun, "--standalone", f"--nproc_per_node={arm.nproc}", *train]


def run_sampled(command: list[str], log_path: Path, timeout_s: float) -> tuple[int, float]:
    """Run `command` in its own session, output to `log_path`. Returns (exit code, peak summed RSS of its
    process tree in MiB). On timeout the whole tree is killed and BenchError raised.

    One torch thread per rank (as torchrun sets for several ranks), so arms with 1 and 2 ranks compare."""
    with log_path.open("w") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=procs.child_env(threads=1), start_new_session=True
        )
    deadline = time.monotonic() + timeout_s
    peak = 0.0
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise BenchError(f"{shlex.join(command)} ran past {timeout_s:.0f} s (log: {log_path})")
            peak = max(peak, procs.tree_rss_mb(proc.pid))
            time.sleep(SAMPLE_S)
    finally:
        if proc.poll() is None:
            procs.stop_tree(proc, grace_s=0.0, sig=None)  # its DHT and averager too, which leave its session
    return proc.returncode, peak


def quartiles(values: list[float]) -> tuple[float, float]:
    """25th and 75th percentiles: how much the per-step figures spread (a shared machine shows it here)."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def read_steps(run_dir: Path) -> list[dict[str, Any]]:
    """The training rows (those with tokens_per_s) of a run's metrics.jsonl, in order."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if "tokens_per_s" in row]


def run_arm(arm: Arm, workload: Workload, work_dir: Path, timeout_s: float = ARM_TIMEOUT_S) -> Measured:
    """Run one arm to the end and measure it from its metrics.jsonl and its process tree."""
    run_dir = work_dir / arm.name
    suffix = 1
    while run_dir.exists():  # repetitions of one arm
        suffix += 1
        run_dir = work_dir / f"{arm.name}-{suffix}"
    command = arm_command(arm, workload, run_dir)
    log.info("bench arm %s: %s", arm.name, shlex.join(command))
    started = time.perf_counter()
    code, tree_peak = run_sampled(command, work_dir / f"{run_dir.name}.log", timeout_s)
    wall = time.perf_counter() - started
    if code != 0:
        tail = (work_dir / f"{run_dir.name}.log").read_text()[-2000:]
        raise BenchError(f"arm {arm.name} exited with code {code}:\n{tail}")
    rows = read_steps(run_dir)
    measured = [row["tokens_per_s"] for row in rows[workload.skip :]]
    summary = json.loads((run_dir / "summary.json").read_text())
    if not measured:
        raise BenchError(f"arm {arm.name} logged {len(rows)} steps, none after the {workload.skip} warm-up steps")
    return Measured(
        name=arm.name,
        command=shlex.join(command),
        tokens_per_s=statistics.median(measured),
        tokens_per_s_iqr=quartiles(measured),
        steps_measured=len(measured),
        peak_memory_mb=max(row["peak_memory_mb"] for row in rows),
        tree_peak_rss_mb=tree_peak,
        wall_s=wall,
        note=arm.note,
        step_tokens_per_s=measured,
        deepspeed=arm.deepspeed,
        rank_peak_mb=summary["peak_memory_mb_per_rank"],
        rank_reserved_mb=summary.get("peak_reserved_mb_per_rank"),
    )


def pooled(arm: Arm, runs: list[Measured]) -> dict[str, Any]:
    """One arm over its repetitions: median tokens/s of all measured steps, the largest peaks."""
    steps = [v for r in runs for v in r.step_tokens_per_s]
    return {
        "name": arm.name,
        "command": runs[0].command,
        "tokens_per_s": statistics.median(steps),
        "tokens_per_s_iqr": quartiles(steps),
        "run_medians": [r.tokens_per_s for r in runs],
        "steps_measured": len(steps),
        "peak_memory_mb": max(r.peak_memory_mb for r in runs),
        "tree_peak_rss_mb": max(r.tree_peak_rss_mb for r in runs),
        "rank_peak_mb": [max(peaks) for peaks in zip(*(r.rank_peak_mb for r in runs))],
        "rank_reserved_mb": (
            [max(peaks) for peaks in zip(*(r.rank_reserved_mb for r in runs))] if runs[0].rank_reserved_mb else None
        ),
        "note": arm.note,
    }


# ---------------------------------------------------------------- reporting


def workload_dict(workload: Workload) -> dict[str, Any]:
    return asdict(workload) | {
        "model": str(workload.model),
        "tokens_per_step": workload.seq_length * workload.total_batch,
    }


def markdown(result: dict[str, Any]) -> str:
    """A dated section: machine, command, how each arm ran, and the table of measured figures."""
    w, gpu = result["workload"], bool(result["machine"]["gpus"])
    memory = "peak allocated GPU memory of rank 0 (MB)" if gpu else "peak RSS of rank 0 (MB)"
    each_arm = (
        f"`{result['arms'][0]['command']}`, with the arm's flags in place of its own (run dirs in a temporary "
        "folder; OMP_NUM_THREADS=1 per rank)"
    )
    steps = (
        f"model {Path(w['model']).name}, {w['tokens_per_step']} tokens per inner step, {w['steps']} steps per run, "
        f"tokens/s = median over steps {w['skip'] + 1}..{w['steps']} (all ranks together), from metrics.jsonl"
    )
    load = f"{result['machine']['load_avg_1m']:.1f} / {result['load_avg_1m_end']:.1f}"
    tree = f"summed over launcher, ranks and their DHT/averager children, sampled every {SAMPLE_S} s"
    lines = [
        *section_head(result),
        f"- each arm: {each_arm}",
        f"- {steps}",
        f"- process tree peak RSS: {tree}",
        f"- 1-minute load average at start / end: {load} (other work here makes tokens/s noisy: see the quartiles)",
    ]
    if "ratio" in result:
        lines.append(f"- {result['repetitions']} repetitions per arm, alternating (A B A B ...)")
    deepspeed = any(arm.get("deepspeed") for arm in result["arms"])  # a column only where arms map to ZeRO stages
    per_rank = "per rank: peak allocated / reserved GPU memory (MB)" if gpu else "per rank: peak RSS (MB)"
    header = ["arm", *(["DeepSpeed ZeRO"] if deepspeed else []), "tokens/s (median)", "tokens/s (p25–p75)", memory,
              per_rank, "process tree peak RSS (MB)", "note"]  # fmt: skip
    align = ["---", *(["---"] if deepspeed else []), "---:", "---:", "---:", "---:", "---:", "---"]
    lines += ["", row(header), "|" + "|".join(align) + "|"]
    for arm in result["arms"]:
        low, high = arm["tokens_per_s_iqr"]
        lines.append(
            row([arm["name"], *([arm.get("deepspeed") or "-"] if deepspeed else []), f"{arm['tokens_per_s']:.0f}",
                 f"{low:.0f}–{high:.0f}", f"{arm['peak_memory_mb']:.0f}", rank_memory(arm),
                 f"{arm['tree_peak_rss_mb']:.0f}", arm["note"]])  # fmt: skip
        )
    if "ratio" in result:
        verdict = "meets" if result["ratio"] >= result["target"] else "misses"
        medians = "; ".join(f"{a['name']} " + ", ".join(f"{v:.0f}" for v in a["run_medians"]) for a in result["arms"])
        ratio = f"Ratio DiLoCo ÷ alone: **{result['ratio']:.3f}** ({verdict} the {result['target']} target)."
        lines += ["", f"{ratio} Per-run medians: {medians}."]
    return "\n".join(lines) + "\n"


def rank_memory(arm: dict[str, Any]) -> str:
    """Each rank's peak, `allocated/reserved` on a GPU; `-` for results from before per-rank figures."""
    allocated, reserved = arm.get("rank_peak_mb") or [], arm.get("rank_reserved_mb")
    if reserved:
        return ", ".join(f"{a:.0f}/{r:.0f}" for a, r in zip(allocated, reserved))
    return ", ".join(f"{a:.0f}" for a in allocated) or "-"


def row(cells: list[str]) -> str:
    """One markdown table row."""
    return "| " + " | ".join(cells) + " |"

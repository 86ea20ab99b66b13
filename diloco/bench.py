"""Benchmarks that run the real trainer as subprocesses and record what they measured.

`diloco bench strategies` compares FSDP sharding strategies, CPU offload and gradient checkpointing (2 ranks
under torchrun, one worker group); `diloco bench overhead` compares the inner-step throughput of a DiLoCo
worker (galaxy size 2: DHT and averager running) with the same model alone (galaxy size 1). Each writes a
JSON file and appends a dated markdown table to a document. Every figure comes from a run's metrics.jsonl,
or from sampling the run's process tree: none is typed in.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger("diloco")

MODELS = Path(__file__).resolve().parent.parent / "tests" / "models"  # the checkout's tiny model configs
SAMPLE_S = 0.2  # how often the process tree's RSS is sampled
ARM_TIMEOUT_S = 600.0
OVERHEAD_TARGET = 0.98
DOC_HEAD = """# Benchmarks

Each section below was appended by one run of `diloco bench strategies` or `diloco bench overhead` (`--quick`:
a smoke run): the date, the machine, the exact command, and the figures it measured; none is typed in by hand.
The JSON of the latest run of each bench is in `docs/bench/`. tokens/s counts the tokens of all ranks of a
group per second of inner steps; on a machine shared with other work it follows their load, so each section
gives the load average and the quartiles of the per-step figures.
"""


class BenchError(RuntimeError):
    """An arm failed or measured nothing: the bench stops with one line and exit code 1."""


@dataclass(frozen=True)
class Workload:
    """What every arm of one bench trains. Tokens per inner step = seq_length × total_batch_size."""

    model: Path
    seq_length: int
    per_device_batch: int
    total_batch: int
    steps: int  # inner steps per run
    skip: int  # warm-up steps left out of the median

    def flags(self) -> list[str]:
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


@dataclass
class Measured:
    """One arm's run. tokens_per_s: median over the measured steps (all ranks together); peak_memory_mb: rank
    0's peak RSS on CPU (peak allocated accelerator memory on GPU), from metrics.jsonl; tree_peak_rss_mb: the
    largest summed RSS of the whole process tree (launcher, ranks, DHT/averager children), sampled every
    SAMPLE_S seconds, so a lower bound."""

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


# ---------------------------------------------------------------- running one arm


def arm_command(arm: Arm, workload: Workload, run_dir: Path) -> list[str]:
    """The exact trainer command line of one arm."""
    train = ["-m", "diloco.train", *workload.flags(), *arm.flags, "--run-dir", str(run_dir)]
    if arm.nproc == 1:
        return [sys.executable, *train]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    return [torchrun, "--standalone", f"--nproc_per_node={arm.nproc}", *train]


def child_env() -> dict[str, str]:
    """One torch thread per rank (as torchrun sets for several ranks), so arms with 1 and 2 ranks compare."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def run_sampled(command: list[str], log_path: Path, timeout_s: float) -> tuple[int, float]:
    """Run `command` in its own session, output to `log_path`. Returns (exit code, peak summed RSS of its
    process tree in MiB). On timeout the whole session is killed and BenchError raised."""
    with log_path.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
    deadline = time.monotonic() + timeout_s
    peak = 0.0
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise BenchError(f"{shlex.join(command)} ran past {timeout_s:.0f} s (log: {log_path})")
            peak = max(peak, tree_rss_mb(proc.pid))
            time.sleep(SAMPLE_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, peak


def tree_rss_mb(pid: int) -> float:
    """Summed resident set size of a process and all its descendants, in MiB (0 once it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


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
    )


# ---------------------------------------------------------------- the machine


def machine() -> dict[str, Any]:
    """CPU model, cores (present and usable by this process), RAM in GiB, torch version, GPU names if any, and
    the 1-minute load average now (other work on the machine skews every figure)."""
    import torch

    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpus": gpus,
        "load_avg_1m": os.getloadavg()[0],
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(info: dict[str, Any]) -> str:
    gpu = ", ".join(info["gpus"]) or "none"
    return (
        f"{info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable), {info['ram_gib']} GiB RAM, "
        f"torch {info['torch']}, Python {info['python']}, GPU: {gpu}"
    )


# ---------------------------------------------------------------- strategies


def strategies_workload(quick: bool) -> Workload:
    if quick:
        return Workload(MODELS / "llama-2m-fresh", seq_length=32, per_device_batch=2, total_batch=4, steps=5, skip=2)
    return Workload(MODELS / "llama-14m-fresh", seq_length=128, per_device_batch=4, total_batch=8, steps=16, skip=4)


def strategy_arms(gpu: bool) -> list[Arm]:
    """The five arms, 2 ranks each; CPU offload says when it cannot change anything."""
    offload_note = "" if gpu else "no-op on CPU: parameters and optimizer state already live in CPU memory"
    return [
        Arm("NO_SHARD", ("--sharding-strategy", "NO_SHARD"), 2, "replicated (DDP-like)"),
        Arm("SHARD_GRAD_OP", ("--sharding-strategy", "SHARD_GRAD_OP"), 2, "ZeRO-2: params kept gathered fwd→bwd"),
        Arm("FULL_SHARD", ("--sharding-strategy", "FULL_SHARD"), 2, "ZeRO-3: reshard after forward"),
        Arm("FULL_SHARD+cpu-offload", ("--sharding-strategy", "FULL_SHARD", "--cpu-offload"), 2, offload_note),
        Arm(
            "FULL_SHARD+grad-ckpt",
            ("--sharding-strategy", "FULL_SHARD", "--gradient-checkpointing"),
            2,
            "activations recomputed in backward",
        ),
    ]


def bench_strategies(quick: bool, work_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Run every strategy arm once, one after the other. Returns the result document."""
    workload = strategies_workload(quick)
    arms = [run_arm(arm, workload, work_dir) for arm in strategy_arms(bool(info["gpus"]))]
    return {"workload": workload_dict(workload), "arms": [asdict(m) for m in arms]}


# ---------------------------------------------------------------- overhead


def overhead_workload(quick: bool) -> tuple[Workload, int]:
    """The workload and the repetitions of each arm."""
    if quick:
        return Workload(MODELS / "llama-2m-fresh", seq_length=32, per_device_batch=2, total_batch=2, steps=6, skip=2), 2
    return Workload(MODELS / "llama-14m-fresh", seq_length=128, per_device_batch=4, total_batch=4, steps=16, skip=4), 3


def overhead_arms(workload: Workload, run_id: str) -> list[Arm]:
    """Galaxy size 1 (no DHT) against a lone DiLoCo worker of a galaxy of 2: its DHT and averager run, it waits
    1 s at the rendezvous (before the first step), and H is past the last step, so no outer step is timed."""
    diloco = (
        "--hv.galaxy-size", "2", "--hv.local-steps", str(workload.steps + 1), "--hv.averaging-timeout", "1",
        "--hv.matchmaking-time", "1", "--hv.run-id", run_id, "--hv.host-maddrs", "/ip4/127.0.0.1/tcp/0",
    )  # fmt: skip
    return [
        Arm("galaxy-1", (), 1, "plain training, no hivemind"),
        Arm("diloco-galaxy-2", diloco, 1, "DHT + averager running, no outer step inside the window"),
    ]


def bench_overhead(quick: bool, work_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Alternate the two arms (A B A B ...) `reps` times. Returns the result document, with per-arm medians
    over all measured steps of all repetitions and their ratio (DiLoCo ÷ alone)."""
    workload, reps = overhead_workload(quick)
    arms = overhead_arms(workload, f"bench-{os.getpid()}")
    runs = [run_arm(arm, workload, work_dir) for _ in range(reps) for arm in arms]
    summary = [pooled(arm, [r for r in runs if r.name == arm.name]) for arm in arms]
    ratio = summary[1]["tokens_per_s"] / summary[0]["tokens_per_s"]
    return {
        "workload": workload_dict(workload),
        "repetitions": reps,
        "arms": summary,
        "ratio": ratio,
        "target": OVERHEAD_TARGET,
        "runs": [asdict(r) for r in runs],
    }


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
        f"## {result['bench']}{' (quick)' if result['quick'] else ''}: {result['date']}",
        "",
        f"- machine: {machine_line(result['machine'])}",
        f"- command: `{result['command']}`",
        f"- each arm: {each_arm}",
        f"- {steps}",
        f"- process tree peak RSS: {tree}",
        f"- 1-minute load average at start / end: {load} (other work here makes tokens/s noisy: see the quartiles)",
    ]
    if "ratio" in result:
        lines.append(f"- {result['repetitions']} repetitions per arm, alternating (A B A B ...)")
    header = f"| arm | tokens/s (median) | tokens/s (p25–p75) | {memory} | process tree peak RSS (MB) | note |"
    lines += ["", header, "|---|---:|---:|---:|---:|---|"]
    for arm in result["arms"]:
        low, high = arm["tokens_per_s_iqr"]
        lines.append(
            f"| {arm['name']} | {arm['tokens_per_s']:.0f} | {low:.0f}–{high:.0f} | {arm['peak_memory_mb']:.0f} | "
            f"{arm['tree_peak_rss_mb']:.0f} | {arm['note']} |"
        )
    if "ratio" in result:
        verdict = "meets" if result["ratio"] >= result["target"] else "misses"
        medians = "; ".join(f"{a['name']} " + ", ".join(f"{v:.0f}" for v in a["run_medians"]) for a in result["arms"])
        ratio = f"Ratio DiLoCo ÷ alone: **{result['ratio']:.3f}** ({verdict} the {result['target']} target)."
        lines += ["", f"{ratio} Per-run medians: {medians}."]
    return "\n".join(lines) + "\n"


def append_doc(doc: Path, section: str) -> None:
    """Append a section to the benchmarks document, creating it with a title when missing."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    head = "" if doc.exists() else DOC_HEAD
    with doc.open("a", encoding="utf-8") as f:
        f.write(f"{head}\n{section}")


def command_line(name: str, quick: bool, out: Path, doc: Path, defaults: tuple[Path, Path]) -> str:
    """The `diloco bench` command that reproduces this result."""
    parts = ["diloco", "bench", name, *(["--quick"] if quick else [])]
    if out != defaults[0]:
        parts += ["--out", str(out)]
    if doc != defaults[1]:
        parts += ["--doc", str(doc)]
    return shlex.join(parts)


BENCHES = {"strategies": bench_strategies, "overhead": bench_overhead}


def run(name: str, quick: bool, out: Path, doc: Path, command: str) -> Path:
    """Run bench `name`, write `<out>/<name>[-quick].json`, append its table to `doc`. Returns the JSON path."""
    info = machine()
    with tempfile.TemporaryDirectory(prefix=f"diloco-bench-{name}-") as tmp:
        body = BENCHES[name](quick, Path(tmp), info)
    result = {
        "bench": name,
        "quick": quick,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": info,
        "load_avg_1m_end": os.getloadavg()[0],
        "command": command,
        **body,
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}{'-quick' if quick else ''}.json"
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    append_doc(doc, markdown(result))
    log.info("bench %s: results in %s, table appended to %s", name, path, doc)
    return path

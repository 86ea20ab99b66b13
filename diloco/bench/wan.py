"""`diloco bench wan`: time to a loss on a slow link. Two workers in network namespaces of their own, each behind
a `tc tbf` link of 100 Mbit/s and of 1 Gbit/s (``netns.hosts``), train on real text: DDP (one group of two ranks,
one per namespace, gloo, NO_SHARD: a gradient all-reduce every inner step), DiLoCo with blocking rounds, DiLoCo
with fragments whose rounds overlap the inner steps (``--hv.fragments``, ``--hv.overlap-steps``), and the same with
int4 pseudo-gradients.

Per arm, from the workers' own metrics (``--log-interval 1``; every row carries its wall-clock ``time``):

- *training time*: from the first inner step's start to the end of the last outer step, evaluations left out (each
  eval row's time minus that of the row before it);
- *compute utilisation*: the inner steps' own time (tokens per step ÷ the row's tokens/s; the trainer keeps outer
  steps and evals out of it) ÷ training time. Under DDP the inner step includes its all-reduce, so its utilisation
  is estimated with the blocking arm's median step time instead;
- the final held-out loss (every worker evaluates the whole held-out split; the quick run its first 50 batches,
  where a whole pass took 11 s of a 14 s run) at equal tokens, and the training time
  at which each arm's held-out loss first reaches DDP's final one (``--eval-interval``), ÷ DDP's;
- the link's peak: the most bytes a worker's veth carried in one direction over any 0.5 s window (sampled every 0.25 s);
- for overlapped arms, the median inner step while a round is on the wire against the others (the CPU the
  transport takes from training).

The time to DDP's final loss is interpolated linearly between the two evaluations around the crossing.

Each worker (with its DHT, averager and p2pd processes) is pinned to a core of its own: its transport's CPU comes
out of its training's. ``--train-cores C`` stands for workers whose training runs on an accelerator instead: once
a worker trains, the kernel holds its training process to C of its core (a cgroup quota, ``diloco.bench.throttle``) and
its helper processes leave that core for whatever CPU is spare, as beside a GPU. Every arm trains at that pace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil

from diloco import procs
from diloco.bench import BenchError, netns
from diloco.bench.hetero import read_rows
from diloco.bench.models import model_folder
from diloco.bench.throttle import CpuLimit
from diloco.bench.wire import (
    DDP_PORT,
    Dht,
    dht_peers,
    last_line,
    start_dht,
    started,
    summary,
    wait_all,
)

__all__ = ["markdown", "measure", "plot", "stem"]

WORKERS = 2
SAMPLE_S = 0.25  # how often the veth counters are read
WINDOW_S = 0.5  # the peak rate's window (a round of the full run lasts well under 1 s)
HOLD_POLL_S = 0.05  # how often a starting worker is looked at under --train-cores
WHOLE_SPLIT = 100_000  # --eval-steps past any held-out split's end: the whole split (tinyshakespeare's: 1,742)
QUICK_EVAL_STEPS = 50  # the quick run's evaluations: the held-out split's first batches, the same in every arm


@dataclasses.dataclass(frozen=True)
class Arm:
    """One way to train: DiLoCo flags (None: DDP)."""

    name: str
    flags: tuple[str, ...] | None
    steps_factor: int = 1  # > 1: trains that many times the tokens (to reach DDP's final loss, on the slow link)


@dataclasses.dataclass(frozen=True)
class WanSetup:
    """What every arm trains, per worker: `batch` sequences of `seq_length` per inner step, `steps` inner steps."""

    model: str
    seq_length: int
    batch: int
    steps: int
    lr: float
    warmup: int
    local_steps: int
    fragments: int
    overlap: int
    eval_interval: int
    links_mbit: tuple[float, ...]
    timeout_s: float
    train_cores: float | None = None  # --train-cores: the share of its core each worker's training is held to
    eval_steps: int = WHOLE_SPLIT  # batches per evaluation and worker
    slow_link: bool = False  # --slow-link: blocking int8 against blocking sparse rounds, no DDP

    def arms(self, slowest: bool, quick: bool = False) -> list[Arm]:
        """DDP first, blocking second (the others are compared with them); the full run adds contiguous fragments
        (strided is the default layout), and on the slowest link the overlapped arm trained twice as long, to time
        when it reaches DDP's final loss if it has not by then."""
        if self.slow_link:  # the first arm is the one the others are compared with
            return [Arm("blocking-int8", ("--hv.compression", "int8")),
                    Arm("blocking-sparse", ("--hv.compression", "sparse"))]  # fmt: skip
        streaming = ("--hv.fragments", str(self.fragments), "--hv.overlap-steps", str(self.overlap))
        arms = [
            Arm("ddp", None),
            Arm("blocking", ()),
            Arm("streaming", streaming),
            Arm("streaming-int4", (*streaming, "--hv.compression", "int4")),
        ]
        if not quick:
            arms.append(Arm("streaming-contiguous", (*streaming, "--hv.fragment-layout", "contiguous")))
        return arms + ([Arm("streaming-2x", streaming, steps_factor=2)] if slowest and not quick else [])


def wan_setup(quick: bool, train_cores: float | None = None, slow_link: bool = False) -> WanSetup:
    """Quick (CI): 12 steps of a 0.14M model on one 1 Gbit/s link (10 Mbit/s with `slow_link`), evaluated on 50
    batches. Full: 300 steps of a 1.1M-parameter model, H = 20 (fragments: 2, a round every 10 steps, 8 of them on
    the wire), on 100 Mbit/s and 1 Gbit/s (10 Mbit/s with `slow_link`), evaluated on the whole held-out split."""
    if quick:
        return WanSetup("llama-0.1m-bytes", 32, 2, 12, 3e-3, 2, 4, 2, 1, 6, (10.0,) if slow_link else (1000.0,),
                        240.0, train_cores, eval_steps=QUICK_EVAL_STEPS, slow_link=slow_link)  # fmt: skip
    links = (10.0,) if slow_link else (100.0, 1000.0)
    return WanSetup("llama-1m-bytes", 128, 4, 300, 3e-3, 20, 20, 2, 8, 30, links, 900.0, train_cores,
                    slow_link=slow_link)  # fmt: skip


def stem(quick: bool, train_cores: float | None = None, slow_link: bool = False, **_: Any) -> str:
    """The JSON's and plot's name: wan, wan-quick, wan-cores0.75, wan-10mbit (runs with --train-cores or
    --slow-link are kept apart)."""
    link = "-10mbit" if slow_link else ""
    return f"wan{link}{'' if train_cores is None else f'-cores{train_cores:g}'}{'-quick' if quick else ''}"


def train_flags(setup: WanSetup, model: Path, data: Path, run_dir: Path, ranks: int, steps: int) -> list[str]:
    batch = ["--per-device-train-batch-size", str(setup.batch), "--total-batch-size", str(setup.batch * ranks)]
    return [
        "-m", "diloco.train", "--path-model", str(model), "--dataset", str(data), "--seq-length",
        str(setup.seq_length), *batch, "--max-steps", str(steps), "--lr", str(setup.lr), "--warmup-steps",
        str(setup.warmup), "--eval-interval", str(setup.eval_interval), "--eval-steps", str(setup.eval_steps),
        "--log-interval", "1", "--no-torch-compile", "--precision", "32-true", "--metric-logger-type", "dummy",
        "--run-dir", str(run_dir),
    ]  # fmt: skip


def commands(setup: WanSetup, arm: Arm, hosts: list[netns.Host], peers: list[str], model: Path, data: Path,
             arm_dir: Path) -> list[list[str]]:  # fmt: skip
    """Each worker's command, inside its namespace, pinned to a core of its own where there are enough (as on
    machines of their own: a worker's transport then takes CPU from its own training only)."""
    steps = setup.steps * arm.steps_factor
    cores = os.cpu_count() or 1
    pin = [[shutil.which("taskset") or "taskset", "-c", str(i)] if cores >= WORKERS else [] for i in range(WORKERS)]
    if arm.flags is None:
        torchrun = str(Path(sys.executable).parent / "torchrun")
        launch = [torchrun, "--nnodes", str(WORKERS), "--nproc-per-node", "1", "--master-addr", hosts[0].ip,
                  "--master-port", str(DDP_PORT)]  # fmt: skip
        train = [*train_flags(setup, model, data, arm_dir / "run", WORKERS, steps), "--sharding-strategy", "NO_SHARD"]
        return [[*hosts[i].prefix(), *pin[i], *launch, "--node-rank", str(i), *train] for i in range(WORKERS)]
    out = []
    for i in range(WORKERS):
        hv = ["--hv.galaxy-size", str(WORKERS), "--hv.world-rank", str(i), "--hv.pace", "fixed", "--hv.local-steps",
              str(setup.local_steps), "--hv.run-id", f"wan-{arm.name}", "--hv.matchmaking-time", "10",
              "--hv.averaging-timeout", "60", "--hv.host-maddrs", f"/ip4/{hosts[i].ip}/tcp/0", "--hv.initial-peers",
              *peers, *arm.flags]  # fmt: skip
        train = train_flags(setup, model, data, arm_dir / f"w{i}", 1, steps)
        out.append([*hosts[i].prefix(), *pin[i], sys.executable, *train, *hv])
    return out


class LinkSampler:
    """Reads the workers' veth counters every SAMPLE_S on a thread; `peak()` is the most bytes per second one
    worker's link carried in one direction over a WINDOW_S window."""

    def __init__(self, hosts: list[netns.Host]) -> None:
        self.hosts, self.samples = hosts, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LinkSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), [h.counters() for h in self.hosts]))
            self._stop.wait(SAMPLE_S)

    def peak(self) -> float:
        best, span = 0.0, round(WINDOW_S / SAMPLE_S)
        for (t0, before), (t1, after) in zip(self.samples, self.samples[span:]):
            for b, a in zip(before, after):
                best = max(best, (a[0] - b[0]) / (t1 - t0), (a[1] - b[1]) / (t1 - t0))
        return best


def run_arm(setup: WanSetup, arm: Arm, hosts: list[netns.Host], dht: Dht | None, model: Path, data: Path,
            work_dir: Path) -> dict[str, Any]:  # fmt: skip
    """One arm on `hosts` (the workers' namespaces); its figures."""
    arm_dir = work_dir / arm.name
    arm_dir.mkdir(parents=True)
    runs = [arm_dir / "run"] if arm.flags is None else [arm_dir / f"w{i}" for i in range(WORKERS)]
    with ExitStack() as stack:
        peers = []
        if dht is not None:
            stack.callback(procs.stop_tree, dht.proc, 0.0)
            peers = dht_peers(dht.proc, dht.log_path)
        cmds = commands(setup, arm, hosts, peers, model, data, arm_dir)
        jobs = []
        with LinkSampler(hosts) as link:
            for i, cmd in enumerate(cmds):
                env = procs.child_env(GLOO_SOCKET_IFNAME=hosts[i].iface, OMP_NUM_THREADS="1")
                log_path = arm_dir / f"w{i}.log"
                jobs.append((f"{arm.name} worker {i}", started(stack, cmd, log_path, env), log_path))
            held = []
            if setup.train_cores is not None:
                # DDP's ranks train in lockstep: rank 0's metrics file says both started
                ready = [runs[i % len(runs)] / "metrics.jsonl" for i in range(WORKERS)]
                held = hold_training(stack, setup.train_cores, jobs, ready, setup.timeout_s)
            wait_all(jobs, setup.timeout_s)
            held = [{"cores": limit.cores if limit.engaged else None, "helpers": helpers,
                     **dataclasses.asdict(limit.usage())} for limit, helpers in held]  # fmt: skip
    figures = [run_figures(read_rows(d), setup.seq_length * setup.batch * (WORKERS if arm.flags is None else 1))
               for d in runs]  # fmt: skip
    finals = [summary(d) for d in runs]
    if arm.flags is not None and len({f["params_sha256"] for f in finals}) != 1:
        raise BenchError(f"{arm.name}: the workers ended on different models, see {arm_dir}")
    return {
        "name": arm.name,
        "steps": setup.steps * arm.steps_factor,
        "flags": list(arm.flags) if arm.flags is not None else None,
        "command": shlex.join(cmds[0]),
        "peak_link_bytes_per_s": link.peak(),
        "final_eval_loss": finals[0]["final_eval_loss"],
        **figures[0],
        "workers": figures,
        **({"held": held} if held else {}),
    }


def hold_training(stack: ExitStack, cores: float, jobs: list[tuple[str, Any, Path]], ready: list[Path],
                  timeout_s: float) -> list[tuple[CpuLimit, int]]:  # fmt: skip
    """--train-cores: as soon as a worker trains (its `ready` file exists: imports done, swarm joined), hold its
    training process to `cores` of a core and move its helpers (hivemind's DHT and averager, p2pd) out of the
    quota and off its core, onto whatever CPU is spare. The limits are lifted when `stack` closes. Returns each
    worker's limit and how many helper processes left it."""
    limits = [stack.enter_context(CpuLimit(f"wan-w{i}", cores, engaged=False)) for i in range(len(jobs))]
    released = [0] * len(jobs)
    every_core = list(range(os.cpu_count() or 1))
    pending, deadline = set(range(len(jobs))), time.monotonic() + timeout_s
    while pending:
        for i in sorted(pending):
            name, proc, log_path = jobs[i]
            if proc.poll() not in (None, 0):
                raise BenchError(f"{name} exited with code {proc.returncode}: {last_line(log_path)}")
            trainer = training_process(proc.pid)
            if trainer is None or not ready[i].exists():
                continue
            limits[i].add(trainer)
            limits[i].release(trainer)
            for helper in helpers(trainer):
                with contextlib.suppress(psutil.NoSuchProcess):
                    helper.cpu_affinity(every_core)
                    released[i] += 1
            limits[i].engage()
            pending.discard(i)
        if pending and time.monotonic() > deadline:
            raise BenchError(f"{', '.join(jobs[i][0] for i in sorted(pending))} did not start training")
        time.sleep(HOLD_POLL_S)
    return list(zip(limits, released))


def training_process(pid: int) -> int | None:
    """The process that trains: `pid` itself (a DiLoCo worker), or under torchrun (DDP) its rank, once started."""
    try:
        launcher = psutil.Process(pid)
        if not any("torchrun" in part for part in launcher.cmdline()[:2]):
            return pid
        ranks = [c for c in launcher.children() if "diloco.train" in " ".join(c.cmdline())]
    except psutil.NoSuchProcess:
        return None
    return ranks[0].pid if ranks else None


def helpers(pid: int) -> list[psutil.Process]:
    """The processes a trainer started (hivemind's DHT and averager, p2pd)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def run_figures(rows: list[dict[str, Any]], tokens_per_step: int) -> dict[str, Any]:
    """One worker's times from its metrics rows (see the module's docstring)."""
    steps = [r for r in rows if "tokens_per_s" in r]
    if not steps:
        raise BenchError("a worker logged no inner step")
    step_s = {r["step"]: tokens_per_step / r["tokens_per_s"] for r in steps}
    start = steps[0]["time"] - step_s[steps[0]["step"]]
    evals, eval_s, durations, previous = [], 0.0, [], None
    for row in rows:
        if "eval_loss" in row and previous is not None and row["time"] > start:
            eval_s += row["time"] - previous["time"]
            durations.append((row["time"], row["time"] - previous["time"]))
            evals.append((row["time"] - start - eval_s, row["eval_loss"]))
        previous = row
    last = max(r["time"] for r in rows if "eval_loss" not in r)  # the last step's row, or the final round's
    train_s = last - start - sum(d for t, d in durations if t <= last)
    landed = [r for r in rows if "round_step" in r]
    on_wire = {s for r in landed for s in range(r["round_step"] + 1, r["step"] + 1)}
    blocking = [r["averaging_s"] for r in rows if "averaging_s" in r and "round_step" not in r]
    wire = [s for step, s in step_s.items() if step in on_wire]
    off = [s for step, s in step_s.items() if step not in on_wire]
    return {
        "train_s": train_s,
        "inner_s": sum(step_s.values()),
        "utilisation": sum(step_s.values()) / train_s,
        "median_step_s": statistics.median(step_s.values()),
        "median_step_s_on_wire": statistics.median(wire) if wire else None,
        "median_step_s_off_wire": statistics.median(off) if off else None,
        "evals": evals,
        "rounds": sum(1 for r in rows if "outer_step" in r and "num_peers" in r),
        "round_s_total": sum(blocking),
        "land_wait_s_total": sum(r["land_wait_s"] for r in landed),
        "land_s_total": sum(r.get("land_s", 0.0) for r in landed),  # the waits, the outer steps, the records
        "side_cpu_s_total": sum(r.get("side_cpu_s", 0.0) for r in landed),  # the round's threads' CPU
        "blocking_round_s": statistics.median(blocking or [0.0]),
    }


def time_to(evals: list[list[float]] | list[tuple[float, float]], loss: float) -> float | None:
    """The training time at which the held-out loss first reaches `loss` (None: never), interpolated linearly
    between the evaluation before and the first one at or below it."""
    previous = None
    for t, value in evals:
        if value <= loss + 1e-12:
            if previous is None or previous[1] <= value:
                return t
            t0, v0 = previous
            return t0 + (t - t0) * (v0 - loss) / (v0 - value)
        previous = (t, value)
    return None


def link_figures(setup: WanSetup, arms: list[dict[str, Any]]) -> None:
    """Add what compares the arms of one link: DDP's estimated utilisation, time to DDP's final loss and its
    ratio, the eval loss against the blocking arm's."""
    if setup.slow_link:  # no DDP: against the first (dense) blocking arm
        for arm in arms:
            arm["time_to_ddp_loss_s"] = arm["time_to_ddp_loss_ratio"] = None
            arm["eval_vs_blocking"] = arm["final_eval_loss"] / arms[0]["final_eval_loss"] - 1
        return
    ddp, blocking = arms[0], arms[1]
    ddp["utilisation"] = setup.steps * blocking["median_step_s"] / ddp["train_s"]
    ddp["utilisation_estimated"] = True
    target = ddp["final_eval_loss"]
    ddp_time = time_to(ddp["evals"], target)
    for arm in arms:
        arm["time_to_ddp_loss_s"] = time_to(arm["evals"], target)
        reached = arm["time_to_ddp_loss_s"]
        arm["time_to_ddp_loss_ratio"] = None if reached is None or not ddp_time else reached / ddp_time
        arm["eval_vs_blocking"] = arm["final_eval_loss"] / blocking["final_eval_loss"] - 1


def measure(quick: bool, work_dir: Path, info: dict[str, Any], data: Path,
            train_cores: float | None = None, slow_link: bool = False) -> dict[str, Any]:  # fmt: skip
    """Every arm on every link, one after another (the arms of a link share its namespaces; each DiLoCo arm has
    a bootstrap DHT peer of its own, all started at the outset)."""
    setup = wan_setup(quick, train_cores, slow_link)
    model = model_folder(setup.model, work_dir / "models")
    links = []
    for rate in setup.links_mbit:
        link_dir = work_dir / f"{rate:g}mbit"
        arms = setup.arms(slowest=rate == min(setup.links_mbit), quick=quick)
        swarms = [arm for arm in arms if arm.flags is not None]
        with netns.hosts(WORKERS + len(swarms), rate) as hosts, ExitStack() as stack:
            dht_hosts = iter(hosts[WORKERS:])
            dhts = {}
            for arm in swarms:
                host, log_path = next(dht_hosts), link_dir / f"dht-{arm.name}.log"
                log_path.parent.mkdir(parents=True, exist_ok=True)
                dhts[arm.name] = Dht(host, start_dht(stack, host, log_path), log_path)
            results = [run_arm(setup, arm, hosts[:WORKERS], dhts.get(arm.name), model, data, link_dir)
                       for arm in arms]  # fmt: skip
        link_figures(setup, results)
        links.append({"rate_mbit": rate, "arms": results})
    return {
        "setup": dataclasses.asdict(setup),
        "data": data.name,
        "links": links,
        "targets": sparse_targets(links) if slow_link else targets(links),
    }


def targets(links: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets on the slowest link: the overlapped arm's utilisation ≥ 0.97 where blocking is ≤ 0.80,
    its eval loss within 1% of blocking, its time to DDP's final loss ≤ 0.33 of DDP's."""
    slow = min(links, key=lambda link: link["rate_mbit"])
    arms = {arm["name"]: arm for arm in slow["arms"]}
    streaming, blocking = arms["streaming"], arms["blocking"]
    reached = [a["time_to_ddp_loss_ratio"] for name, a in arms.items() if name.startswith("streaming")]
    ratio = min((r for r in reached if r is not None), default=None)  # the 2x arm trains on to reach it
    return {
        "link_mbit": slow["rate_mbit"],
        "blocking_utilisation_at_most_0.80": blocking["utilisation"] <= 0.80,
        "streaming_utilisation_at_least_0.97": streaming["utilisation"] >= 0.97,
        "streaming_eval_within_1pct_of_blocking": abs(streaming["eval_vs_blocking"]) <= 0.01
        or streaming["eval_vs_blocking"] < 0,
        "streaming_time_to_ddp_loss_at_most_0.33": ratio is not None and ratio <= 0.33,
        "streaming_time_to_ddp_loss_ratio": ratio,
    }


def sparse_targets(links: list[dict[str, Any]]) -> dict[str, Any]:
    """The 10 Mbit/s study's target: blocking sparse rounds at a compute utilisation of 0.95 or more (int8's is
    measured beside it)."""
    arms = {arm["name"]: arm for arm in links[0]["arms"]}
    return {
        "link_mbit": links[0]["rate_mbit"],
        "sparse_utilisation_at_least_0.95": arms["blocking-sparse"]["utilisation"] >= 0.95,
        "int8_utilisation": arms["blocking-int8"]["utilisation"],
    }


# ---------------------------------------------------------------- the report


def fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(result: dict[str, Any]) -> str:
    """A dated section: setup, one table per link, the targets."""
    from diloco.bench import machine_line

    s = result["setup"]
    load = f"{result['machine']['load_avg_1m']:.1f} / {result['load_avg_1m_end']:.1f}"
    lines = [f"## {result['bench']}{' (quick)' if result['quick'] else ''}: {result['date']}", ""]
    lines += [
        f"- machine: {machine_line(result['machine'])}; 1-minute load average at start / end: {load}",
        f"- command: `{result['command']}`",
        f"- model {s['model']}, {result['data']}, seq {s['seq_length']}, {s['batch']} sequences per worker per inner "
        f"step, {s['steps']} inner steps in every arm (equal tokens), lr {s['lr']:g} with {s['warmup']} warm-up "
        f"steps; held-out loss every {s['eval_interval']} steps over "
        + ("the whole held-out split" if s.get("eval_steps", WHOLE_SPLIT) >= WHOLE_SPLIT else
           f"the held-out split's first {s['eval_steps']} batches"),
        f"- {WORKERS} workers, each in a network namespace behind a `tc tbf` link (both directions); "
        + ("" if s.get("slow_link") else "DDP: one group of 2 ranks (torchrun multi-node, gloo, NO_SHARD); ")
        + f"DiLoCo: 2 groups of 1 rank, H = {s['local_steps']}, outer setting auto"
        + ("" if s.get("slow_link") else f"; streaming: `--hv.fragments {s['fragments']} --hv.overlap-steps "
           f"{s['overlap']}` (mix 0.5)"),
        "- each worker (and its DHT, averager and p2pd processes) is pinned to a core of its own with `taskset`, "
        "as on a machine of its own" + (
            "" if s.get("train_cores") is None else
            f"; `--train-cores {s['train_cores']:g}`: once it trains, each worker's training process is held to "
            f"{s['train_cores']:g} of its core (cgroup quota) and its helpers move off that core to spare CPU, as "
            "beside an accelerator that trains"
        ) + ("" if s.get("slow_link") else "; streaming-contiguous: `--hv.fragment-layout contiguous` (the others "
             "strided); streaming-2x (slowest link only) trains twice the steps, to time when it reaches DDP's final "
             "loss: its loss is not at equal tokens; time to DDP's loss: interpolated between the evaluations around "
             "the crossing"),
        *(["- the 10 Mbit/s study (`--slow-link`): DiLoCo's blocking rounds in int8 against sparse rounds "
           "(`--hv.compression sparse`: a 64th of each chunk in 2 bits, error feedback), no DDP; vs blocking: "
           "against blocking-int8; a blocking round's time is its matchmaking (the group forming through the DHT) "
           "and its all-reduce, both on the link"] if s.get("slow_link") else []),
        "- training time: first inner step to the last round, evaluations left out; utilisation: the inner steps' "
        "own time ÷ training time (DDP: its steps at the blocking arm's median step time ÷ its training time, as "
        "its all-reduce is inside its steps); peak: the most bytes one worker's link carried one way in 0.5 s, "
        "per second",
        "",
    ]
    for link in result["links"]:
        lines += [f"**{link['rate_mbit']:g} Mbit/s**", "",
                  "| arm | steps | training s | utilisation | final eval loss | vs blocking | time to DDP's loss s | "
                  "÷ DDP | peak MB/s | rounds | step s off / on the wire |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for a in link["arms"]:
            est = "~" if a.get("utilisation_estimated") else ""
            wire = (f"{fmt(a['median_step_s_off_wire'], '.3f')} / {fmt(a['median_step_s_on_wire'], '.3f')}"
                    if a["median_step_s_on_wire"] else fmt(a["median_step_s"], ".3f"))  # fmt: skip
            lines.append(
                f"| {a['name']} | {a['steps']} | {a['train_s']:.1f} | {est}{a['utilisation']:.3f} | "
                f"{a['final_eval_loss']:.4f} | {a['eval_vs_blocking']:+.2%} | {fmt(a['time_to_ddp_loss_s'], '.1f')} | "
                f"{fmt(a['time_to_ddp_loss_ratio'], '.2f')} | {a['peak_link_bytes_per_s'] / 1e6:.2f} | {a['rounds']} | "
                f"{wire} |"
            )
        for a in link["arms"]:
            if a.get("land_s_total"):
                lines.append(
                    f"- {a['name']}: landings {a['land_s_total']:.2f} s in all (waiting for the round "
                    f"{a['land_wait_s_total']:.2f} s), blocking rounds {a['round_s_total']:.2f} s; the trainer's "
                    f"threads beside training used {a['side_cpu_s_total']:.2f} CPU-s while rounds were on the wire "
                    f"(worker 0)"
                )
        lines.append("")
    t = result["targets"]
    verdict = ", ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in t.items() if isinstance(ok, bool))
    lines.append(f"Targets at {t['link_mbit']:g} Mbit/s: {verdict}.")
    if "plot" in result:
        lines += ["", f"![held-out loss against training time]({result['plot']})"]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], out: Path) -> Path:
    """Held-out loss against training time, one panel per link, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = result["links"]
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4), squeeze=False)
    for ax, link in zip(axes[0], links):
        for arm in link["arms"]:
            if arm["evals"]:
                times, losses = zip(*arm["evals"])
                ax.plot(times, losses, marker=".", label=arm["name"])
        ax.set(title=f"{link['rate_mbit']:g} Mbit/s", xlabel="training time (s)", ylabel="held-out loss")
        ax.legend()
    fig.tight_layout()
    setup = result["setup"]
    path = out / f"{stem(result['quick'], setup.get('train_cores'), setup.get('slow_link', False))}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

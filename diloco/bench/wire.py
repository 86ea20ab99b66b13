"""`diloco bench wire`: bytes each worker sends and receives over a whole run, DiLoCo (compression none, fp16,
int8, sparse; `--quick` leaves fp16 out) against DDP, counted by the kernel and by the trainer.

Every worker runs in a network namespace of its own, joined to a bridge by a veth pair (`netns.hosts`); the
kernel's byte counters on that veth are read before the worker starts and after it ends, so they hold all it
sent and received: TCP/IP headers, DHT, matchmaking and the averaging payload. The trainer's own counters
(`bytes_sent` / `bytes_received` of the outer-step rows in metrics.jsonl) hold only the serialized averaging
messages. DiLoCo runs two worker groups of one rank each; DDP one group of two ranks (one per namespace,
torchrun multi-node, NO_SHARD: a gradient all-reduce every inner step), for which the trainer counts nothing,
so its payload is computed (ring all-reduce), never counted. Bytes are reported in MB = 10^6 bytes.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from diloco import procs
from diloco.bench import BenchError, machine_line, netns, shielded, stopping
from diloco.bench.arms import Workload, workload_dict
from diloco.errors import first_line

__all__ = ["markdown", "measure"]

log = logging.getLogger("diloco")

COMPRESSIONS = ("none", "fp16", "int8", "sparse")
QUICK_COMPRESSIONS = ("none", "int8", "sparse")  # fp16 halves the bytes (test_swarm checks it): one arm spared
WORKERS = 2  # DiLoCo worker groups (one rank each), and DDP ranks: one per namespace
PARAM_BYTES = 4  # float32 parameters and gradients (--precision 32-true)
DDP_PORT = 29500  # torchrun's store in the first namespace, which holds nothing else
DHT_START_S = 60.0  # seconds the bootstrap peer may take to print its multiaddrs
STOP_GRACE_S = 10.0  # seconds a process gets to exit after SIGINT before it and its descendants are killed
STOPPED_GRACE_S = 2.0  # ... when the bench itself was stopped: nothing it would measure is kept
POLL_S = 0.1
MB = 1e6


@dataclasses.dataclass(frozen=True)
class WireSetup:
    """What every arm trains: `workload` is one worker's (its total batch = its own batch), `local_steps` is H."""

    workload: Workload
    local_steps: int
    timeout_s: float  # per arm
    # a full group ends matchmaking at once, so a long window costs nothing when both groups come; it only lets a
    # group delayed by load (the quick bench runs inside the busy test suite) still meet the other one
    matchmaking_s: float
    compressions: tuple[str, ...] = COMPRESSIONS  # the DiLoCo arms, in this order, then DDP


def wire_setup(quick: bool) -> WireSetup:
    """Quick: a 0.26M-parameter model, 12 inner steps, H = 4. Full: 1.3M parameters, 240 steps, H = 40."""
    if quick:
        tiny = Workload("llama-2m-fresh", seq_length=32, per_device_batch=2, total_batch=2, steps=12, skip=0)
        return WireSetup(tiny, local_steps=4, timeout_s=150.0, matchmaking_s=30.0, compressions=QUICK_COMPRESSIONS)
    small = Workload("llama-1m-fresh", seq_length=64, per_device_batch=4, total_batch=4, steps=240, skip=0)
    return WireSetup(small, local_steps=40, timeout_s=600.0, matchmaking_s=10.0)


def count_parameters(model: Path) -> int:
    """Parameters of the model the trainer builds from `model`'s config (on the meta device: nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as e:
        raise BenchError(f"{model}: no readable model config ({first_line(e)})") from None
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


# ---------------------------------------------------------------- processes


def spawn(command: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start `command` in a session (and process group) of its own, output to `log_path`."""
    with log_path.open("w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def started(stack: ExitStack, command: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`spawn`, with `stop` registered on `stack`: SIGINT, STOP_GRACE_S seconds to exit, then SIGKILL to whatever is
    left of it and its descendants (p2pd, torchrun's ranks); gone when the stack closes, error or not."""
    with shielded():  # a stop signal between the two would leave the process running, unseen by the stack
        proc = spawn(command, log_path, env)
        stack.callback(stop, proc)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    """`procs.stop_tree` with SIGINT: STOP_GRACE_S to exit, or STOPPED_GRACE_S once a stop signal reached the bench
    (`diloco.bench.stopping`): its processes are stopped one after another as its stacks unwind, and a user's stop
    must not take 10 s a worker."""
    procs.stop_tree(proc, STOPPED_GRACE_S if stopping() else STOP_GRACE_S)


def last_line(log_path: Path) -> str:
    """The last non-empty line of a log (for a one-line error)."""
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def wait_all(jobs: list[tuple[str, subprocess.Popen[bytes], Path]], timeout_s: float) -> None:
    """Wait until every (name, process, log) has exited with code 0; BenchError (one line) as soon as one fails
    or when `timeout_s` seconds pass."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [proc.poll() for _, proc, _ in jobs]
        for (name, _, log_path), code in zip(jobs, codes):
            if code not in (None, 0):
                raise BenchError(f"{name} exited with code {code}: {last_line(log_path)}")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            running = [name for (name, _, _), code in zip(jobs, codes) if code is None]
            raise BenchError(f"{', '.join(running)} still running after {timeout_s:.0f} s")
        time.sleep(POLL_S)


def start_dht(stack: ExitStack, host: netns.Host, log_path: Path, *flags: str) -> subprocess.Popen[bytes]:
    """`diloco dht` inside `host`'s namespace, listening on its address, with `flags` (stopped when `stack`
    closes)."""
    command = [*host.prefix(), sys.executable, "-m", "diloco", "dht", "--identity", str(log_path.with_suffix(".pem")),
               "--host-maddrs", f"/ip4/{host.ip}/tcp/0", *flags]  # fmt: skip
    return started(stack, command, log_path, procs.child_env())


def dht_peers(proc: subprocess.Popen[bytes], log_path: Path) -> list[str]:
    """The --hv.initial-peers multiaddrs a started `diloco dht` prints (waits up to DHT_START_S seconds)."""
    deadline = time.monotonic() + DHT_START_S
    while time.monotonic() < deadline:
        if match := re.search(r"--hv\.initial-peers (.+)", log_path.read_text(errors="replace")):
            return match.group(1).split()
        if proc.poll() is not None:
            raise BenchError(f"diloco dht exited with code {proc.returncode}: {last_line(log_path)}")
        time.sleep(POLL_S)
    raise BenchError(f"diloco dht printed no --hv.initial-peers within {DHT_START_S:.0f} s")


# ---------------------------------------------------------------- counting


def deltas(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Per host: (bytes sent, bytes received) between two readings of `Host.counters()`."""
    return [(a[0] - b[0], a[1] - b[1]) for b, a in zip(before, after)]


def summary(run_dir: Path) -> dict[str, Any]:
    """A run's summary.json; BenchError when it is missing or the run did not end ok."""
    path = run_dir / "summary.json"
    if not path.exists():
        raise BenchError(f"{run_dir} has no summary.json")
    done = json.loads(path.read_text())
    if done.get("status") != "ok":
        raise BenchError(f"{run_dir}: run ended with status {done.get('status')!r}")
    return done


def outer_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The outer-step rows of a run that averaged (those with the trainer's byte counters)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if "bytes_sent" in row]


def worker_row(index: int, os_bytes: tuple[int, int], payload: tuple[int, int]) -> dict[str, Any]:
    """One worker's figures, in bytes: OS-counted, payload (trainer-counted or computed), their difference
    (OS − payload) and ratio (OS ÷ payload)."""
    return {
        "worker": index,
        "os_sent_bytes": os_bytes[0],
        "os_received_bytes": os_bytes[1],
        "payload_sent_bytes": payload[0],
        "payload_received_bytes": payload[1],
        "difference_sent_bytes": os_bytes[0] - payload[0],
        "difference_received_bytes": os_bytes[1] - payload[1],
        "ratio_sent": os_bytes[0] / payload[0] if payload[0] else None,
        "ratio_received": os_bytes[1] / payload[1] if payload[1] else None,
    }


# ---------------------------------------------------------------- the arms


def diloco_command(setup: WireSetup, host: netns.Host, rank: int, compression: str, peers: list[str],
                   run_dir: Path) -> list[str]:  # fmt: skip
    """Worker group `rank` (one rank) of a galaxy of WORKERS, inside `host`'s namespace."""
    hv = ["--hv.galaxy-size", str(WORKERS), "--hv.world-rank", str(rank), "--hv.pace", "fixed", "--hv.local-steps", str(setup.local_steps),
          "--hv.compression", compression, "--hv.run-id", f"wire-{compression}",
          "--hv.matchmaking-time", f"{setup.matchmaking_s:g}",
          "--hv.averaging-timeout", "60", "--hv.host-maddrs", f"/ip4/{host.ip}/tcp/0",
          "--hv.initial-peers", *peers]  # fmt: skip
    train = [sys.executable, "-m", "diloco.train", *setup.workload.flags(), *hv, "--run-dir", str(run_dir)]
    return [*host.prefix(), *train]


@dataclasses.dataclass(frozen=True)
class Dht:
    """A DiLoCo arm's bootstrap peer, started ahead of it in a namespace of its own: host, process, log."""

    host: netns.Host
    proc: subprocess.Popen[bytes]
    log_path: Path


def run_diloco(
    setup: WireSetup, workers: list[netns.Host], dht: Dht, compression: str, work_dir: Path
) -> dict[str, Any]:
    """Two DiLoCo worker groups, in `workers[0]` and `workers[1]`, bootstrapping from `dht` (stopped when the arm
    ends). Returns the arm's figures: per worker OS-counted and trainer-counted bytes over the whole run."""
    name = f"diloco-{compression}"
    arm_dir = work_dir / name
    arm_dir.mkdir()
    run_dirs = [arm_dir / f"worker-{i}" for i in range(WORKERS)]
    hosts = [*workers, dht.host]
    with ExitStack() as stack:
        stack.callback(procs.stop_tree, dht.proc, 0.0)  # it holds nothing worth a graceful stop
        peers = dht_peers(dht.proc, dht.log_path)
        commands = [diloco_command(setup, hosts[i], i, compression, peers, run_dirs[i]) for i in range(WORKERS)]
        log.info("bench arm %s: %s", name, shlex.join(commands[0]))
        before, started_at = [h.counters() for h in hosts], time.perf_counter()
        jobs = [(f"{name} worker {i}", started(stack, c, arm_dir / f"worker-{i}.log", procs.child_env()),
                 arm_dir / f"worker-{i}.log") for i, c in enumerate(commands)]  # fmt: skip
        wait_all(jobs, setup.timeout_s)
        wall, counted = time.perf_counter() - started_at, deltas(before, [h.counters() for h in hosts])
    done = [summary(d) for d in run_dirs]
    rows = [outer_rows(d) for d in run_dirs]
    if not all(rows):
        raise BenchError(f"{name}: a worker logged no outer step that averaged")
    if not all(any(r["num_peers"] == WORKERS for r in rs) for rs in rows):
        raise BenchError(f"{name}: no outer round averaged both workers (matchmaking split every round), see {arm_dir}")
    trainer = [(sum(r["bytes_sent"] for r in rs), sum(r["bytes_received"] for r in rs)) for rs in rows]
    return {
        "name": name,
        "compression": compression,
        "commands": [shlex.join(c) for c in commands],
        "wall_s": wall,
        "inner_steps": [d["steps"] for d in done],
        "outer_rounds": [d["outer_steps"] for d in done],
        "rounds_with_all_peers": [sum(r["num_peers"] == WORKERS for r in rs) for rs in rows],
        "payload": "trainer",
        "workers": [worker_row(i, counted[i], trainer[i]) for i in range(WORKERS)],
        "dht_os_sent_bytes": counted[WORKERS][0],
        "dht_os_received_bytes": counted[WORKERS][1],
    }


def ddp_command(setup: WireSetup, hosts: list[netns.Host], rank: int, run_dir: Path) -> list[str]:
    """Node `rank` of a torchrun job over WORKERS namespaces (one rank each), NO_SHARD, galaxy size 1."""
    workload = dataclasses.replace(setup.workload, total_batch=setup.workload.total_batch * WORKERS)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    launch = [torchrun, "--nnodes", str(WORKERS), "--node-rank", str(rank), "--nproc-per-node", "1",
              "--master-addr", hosts[0].ip, "--master-port", str(DDP_PORT)]  # fmt: skip
    train = ["-m", "diloco.train", *workload.flags(), "--sharding-strategy", "NO_SHARD", "--run-dir", str(run_dir)]
    return [*hosts[rank].prefix(), *launch, *train]


def ring_allreduce_bytes(parameters: int, steps: int) -> int:
    """Bytes each of WORKERS ranks sends (and receives) in a ring all-reduce of float32 gradients every step:
    2·(n−1)/n × parameter bytes × steps. Computed, not counted."""
    return round(2 * (WORKERS - 1) / WORKERS * parameters * PARAM_BYTES * steps)


def run_ddp(setup: WireSetup, hosts: list[netns.Host], parameters: int, work_dir: Path) -> dict[str, Any]:
    """One group of two ranks in hosts[0] and hosts[1] (gloo over their veths). Returns the arm's figures:
    per worker OS-counted bytes over the whole run and the computed all-reduce payload."""
    arm_dir = work_dir / "ddp"
    arm_dir.mkdir()
    commands = [ddp_command(setup, hosts, i, arm_dir / "run") for i in range(WORKERS)]
    log.info("bench arm ddp: %s", shlex.join(commands[0]))
    with ExitStack() as stack:
        before, started_at = [h.counters() for h in hosts[:WORKERS]], time.perf_counter()
        jobs = []
        for i, command in enumerate(commands):
            env = procs.child_env(GLOO_SOCKET_IFNAME=hosts[i].iface)
            jobs.append((f"ddp node {i}", started(stack, command, arm_dir / f"node-{i}.log", env),
                         arm_dir / f"node-{i}.log"))  # fmt: skip
        wait_all(jobs, setup.timeout_s)
        wall, counted = time.perf_counter() - started_at, deltas(before, [h.counters() for h in hosts[:WORKERS]])
    steps = summary(arm_dir / "run")["steps"]
    computed = ring_allreduce_bytes(parameters, steps)
    return {
        "name": "ddp",
        "compression": None,
        "commands": [shlex.join(c) for c in commands],
        "wall_s": wall,
        "inner_steps": [steps] * WORKERS,
        "outer_rounds": [0] * WORKERS,
        "rounds_with_all_peers": [0] * WORKERS,
        "payload": "computed",
        "workers": [worker_row(i, counted[i], (computed, computed)) for i in range(WORKERS)],
    }


# ---------------------------------------------------------------- the bench


def per_worker(arm: dict[str, Any], key: Callable[[dict[str, Any]], int]) -> float:
    """Mean over the arm's workers of `key(worker)`, in bytes."""
    return sum(key(w) for w in arm["workers"]) / len(arm["workers"])


def ddp_ratios(arms: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """DDP ÷ each DiLoCo arm, bytes per worker (sent + received, mean of the workers): by the OS counters, and
    by payload (DDP computed ÷ DiLoCo trainer-counted)."""
    ddp = arms[-1]

    def os_total(w: dict[str, Any]) -> int:
        return w["os_sent_bytes"] + w["os_received_bytes"]

    def payload_total(w: dict[str, Any]) -> int:
        return w["payload_sent_bytes"] + w["payload_received_bytes"]

    return {
        arm["name"]: {
            "os": per_worker(ddp, os_total) / per_worker(arm, os_total),
            "payload": per_worker(ddp, payload_total) / per_worker(arm, payload_total),
        }
        for arm in arms[:-1]
    }


def measure(quick: bool, work_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    """The three DiLoCo arms then DDP, one after another, all with their workers in the same two namespaces; each
    DiLoCo arm has a fresh bootstrap DHT peer in a namespace of its own (all started at the outset, while the
    parameters are counted, each stopped when its arm ends). Returns the result document; bytes throughout."""
    setup = wire_setup(quick)
    setup = dataclasses.replace(setup, workload=setup.workload.written(work_dir / "models"))
    with netns.hosts(WORKERS + len(setup.compressions)) as hosts, ExitStack() as stack, ThreadPoolExecutor(1) as pool:
        counting = pool.submit(count_parameters, setup.workload.model)
        workers, logs = hosts[:WORKERS], [work_dir / f"dht-{c}.log" for c in setup.compressions]
        dhts = [Dht(h, start_dht(stack, h, path), path) for h, path in zip(hosts[WORKERS:], logs)]
        arms = [run_diloco(setup, workers, dht, c, work_dir) for dht, c in zip(dhts, setup.compressions)]
        parameters = counting.result()
        arms.append(run_ddp(setup, workers, parameters, work_dir))
    for arm in arms:
        if any(w["os_sent_bytes"] <= 0 or w["os_received_bytes"] <= 0 for w in arm["workers"]):
            raise BenchError(f"{arm['name']}: the kernel counted no bytes on a worker's veth")
    return {
        "workload": workload_dict(setup.workload),
        "model": setup.workload.model.name,
        "parameters": parameters,
        "parameter_bytes": parameters * PARAM_BYTES,
        "inner_steps": setup.workload.steps,
        "local_steps": setup.local_steps,
        "outer_rounds": {arm["name"]: arm["outer_rounds"][0] for arm in arms[:-1]},
        "dht": "bootstrap peer (diloco dht), a fresh one for each DiLoCo arm, in a namespace of its own on the bridge",
        "arms": arms,
        "ddp_over_diloco": ddp_ratios(arms),
    }


# ---------------------------------------------------------------- the report


def mb(value: float) -> str:
    return f"{value / MB:.2f}"


def ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def arm_lines(arm: dict[str, Any]) -> list[str]:
    """Table rows of one arm, one per worker; a DDP payload is marked as computed (*)."""
    mark = "*" if arm["payload"] == "computed" else ""
    lines = []
    for w in arm["workers"]:
        lines.append(
            f"| {arm['name']} | {w['worker']} | {mb(w['os_sent_bytes'])} | {mb(w['os_received_bytes'])} | "
            f"{mb(w['payload_sent_bytes'])}{mark} | {mb(w['payload_received_bytes'])}{mark} | "
            f"{mb(w['difference_sent_bytes'])} | {mb(w['difference_received_bytes'])} | "
            f"{ratio(w['ratio_sent'])} | {ratio(w['ratio_received'])} |"
        )
    return lines


def setup_lines(result: dict[str, Any]) -> list[str]:
    """Bullets: machine, command, what ran and how it was counted."""
    w, arms = result["workload"], result["arms"]
    load = f"{result['machine']['load_avg_1m']:.1f} / {result['load_avg_1m_end']:.1f}"
    rounds = ", ".join(f"{name} {n}" for name, n in result["outer_rounds"].items())
    full = ", ".join(f"{a['name']} {min(a['rounds_with_all_peers'])}" for a in arms[:-1])
    walls = ", ".join(f"{a['name']} {a['wall_s']:.0f} s" for a in arms)
    dht = ", ".join(f"{a['name']} {mb(a['dht_os_sent_bytes'])} / {mb(a['dht_os_received_bytes'])}" for a in arms[:-1])
    return [
        f"- machine: {machine_line(result['machine'])}",
        f"- command: `{result['command']}`",
        f"- model {result['model']} ({result['parameters']:,} parameters, {mb(result['parameter_bytes'])} MB in "
        f"float32), fake data, seq {w['seq_length']}, {w['per_device_batch']} sequences per worker per inner step, "
        f"{result['inner_steps']} inner steps in every arm; DiLoCo H = {result['local_steps']}",
        f"- DiLoCo: {WORKERS} worker groups of 1 rank, each in its own network namespace; the {result['dht']}. Outer "
        f"rounds: {rounds} (with both groups: {full}). DiLoCo worker 0: `{arms[0]['commands'][0]}`",
        f"- DDP: galaxy size 1, one group of {WORKERS} ranks, one per namespace, torchrun multi-node, "
        f"`--sharding-strategy NO_SHARD` (a gloo gradient all-reduce every inner step). Node 0: "
        f"`{arms[-1]['commands'][0]}`",
        "- OS: the kernel's byte counters of each namespace's veth, read before the workers start and after they "
        "end (IP/TCP headers, DHT, matchmaking, torchrun's store and all). Trainer: the sum of `bytes_sent` / "
        "`bytes_received` over the outer-step rows of metrics.jsonl (serialized averaging messages). MB = 10^6 bytes. "
        "**\\*** DDP has no trainer counter: its payload is **computed, not counted**, as a ring all-reduce of "
        f"float32 gradients, 2·(n−1)/n × parameter bytes × inner steps with n = {WORKERS}",
        f"- bootstrap DHT peer, OS-counted MB sent / received: {dht}",
        f"- wall time per arm: {walls}; 1-minute load average at start / end: {load}",
    ]


def markdown(result: dict[str, Any]) -> str:
    """A dated section: setup, the per-worker table (MB = 10^6 bytes), the DDP ÷ DiLoCo ratios."""
    ratios = result["ddp_over_diloco"]
    header = (
        "| arm | worker | OS sent (MB) | OS received (MB) | trainer sent (MB) | trainer received (MB) | "
        "OS − trainer sent (MB) | OS − trainer received (MB) | OS ÷ trainer sent | OS ÷ trainer received |"
    )
    lines = [f"## {result['bench']}{' (quick)' if result['quick'] else ''}: {result['date']}", ""]
    lines += [*setup_lines(result), "", header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm in result["arms"]:
        lines += arm_lines(arm)
    by_os = ", ".join(f"{name} **{r['os']:.1f}×**" for name, r in ratios.items())
    by_payload = ", ".join(f"{name} {r['payload']:.1f}×" for name, r in ratios.items())
    lines += [
        "",
        f"DDP ÷ DiLoCo, bytes per worker (sent + received, mean of the {WORKERS} workers), OS-counted: {by_os}; "
        f"by payload (DDP computed ÷ DiLoCo trainer-counted): {by_payload}.",
    ]
    return "\n".join(lines) + "\n"

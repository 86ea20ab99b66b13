"""`diloco bench allreduce`: the time of one averaging round of the swarm averager (``diloco.swarm``) against what
the machine and the link allow, for both of its transports: "diloco tcp" (hivemind forms the group, the tensor bytes
go over plain TCP sockets between the groupmates, ``diloco.butterfly``) and "hivemind p2pd" (hivemind's own path:
libp2p streams through the p2pd daemons).

On loopback: k peers (each its own DHT peer, joined to one bootstrap DHT in this process, each a ``SwarmAverager``
over one float32 tensor, compression "none") average one tensor of 10M, 50M and 150M parameters with each transport.
References: a plain TCP socket pushing the same bytes between two processes; the same bytes through one libp2p
stream between two p2pd daemons; a ``torch.distributed`` gloo ``all_reduce`` of the same tensor with k ranks. Each
round also records the CPU seconds of every process of every peer (caller, averager, DHT, p2pd): where the time goes.

On a shaped link: the same, each peer in a network namespace of its own whose veth is shaped with ``tc tbf`` to
1 Gbit/s both ways (no added latency: the ``netem`` qdisc is missing on this kernel), against the ideal time (what
each peer must send in a bandwidth-optimal all-reduce ÷ the link rate), a plain TCP stream and a p2pd stream
across the same link.

Every process that measures is a worker subprocess of this one (``python -m diloco.bench.allreduce``), one per peer
(on the shaped link: in that peer's namespace), in a session of its own. A worker imports torch and hivemind once
(3-6 s each on 2 cores: most of a quick run when every arm started processes of its own), then runs the roles it
is sent, one JSON line on stdin each, one after another (a stream end, a gloo rank, a swarm peer), answers in
``TAG {json}`` lines on stdout, and exits when its stdin closes or this process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import logging
import os
import queue
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from diloco.bench import BenchError, machine_line, netns

__all__ = ["markdown", "measure"]

log = logging.getLogger("diloco")

FULL_SIZES = (10_000_000, 50_000_000, 150_000_000)  # float32 parameters
QUICK_SIZES = (250_000,)  # 1 MB: the quick run checks the machinery, not the rates
# 4 MB on the shaped link: tbf lets its 125 kB bucket through at once, a 3% head start at this size (12% at 1 MB,
# and the quick test checks that nothing beats the link by more than 5%)
QUICK_SHAPED_SIZES = (1_000_000,)
ARMS = {"tcp": "diloco tcp", "p2pd": "hivemind p2pd"}  # SwarmAverager transport -> name in the tables
LINK_MBIT = 1000.0  # tbf rate of every veth in the shaped runs, 10^6 bit/s
TARGET_MB_S = 1000.0  # loopback goal, MB/s per peer
TARGET_RATIO = 1.3  # shaped-link goal, measured ÷ ideal
MATCHMAKING_S = 20.0  # peers start together and the group forms as soon as all k joined: rarely waited out
AVERAGING_TIMEOUT_S = 120.0  # one all-reduce may take this long; a silent groupmate is dropped after a quarter
ATTEMPTS = 3  # failed rounds tolerated per size and transport before the bench gives up
START_TIMEOUT_S = 120.0  # longest wait for a worker's imports, a DHT or an averager to start
LINE_TIMEOUT_S = 600.0  # longest wait for one line of a worker (one round, one stream)
SAMPLE_S = 0.2  # RSS sampling period while workers run
CHUNK = 2**22  # bytes per write of the socket and p2pd streams
KINDS = ("caller", "averager", "dht", "p2pd")  # the processes of one swarm peer


@dataclass(frozen=True)
class Plan:
    """What one run measures. sizes: float32 parameters per payload; peers: group sizes; rounds: averaging rounds
    (and gloo calls, socket pushes) per size and transport; shaped_*: the same on the shaped link."""

    sizes: tuple[int, ...]
    peers: tuple[int, ...]
    rounds: int
    shaped_sizes: tuple[int, ...]
    shaped_peers: tuple[int, ...]


def plan(quick: bool) -> Plan:
    if quick:
        return Plan(QUICK_SIZES, (2,), 2, QUICK_SHAPED_SIZES, (2,))
    return Plan(FULL_SIZES, (2, 4), 3, FULL_SIZES, (2, 4))  # 3 rounds: the median is not the first, cold one


def transports() -> tuple[list[str], dict[str, str]]:
    """The transports this checkout's SwarmAverager offers (keys of ARMS, in order), and why any other is left out.
    A SwarmAverager without a ``transport`` parameter has only hivemind's p2pd path."""
    from diloco.swarm import SwarmAverager

    if "transport" in inspect.signature(SwarmAverager).parameters:
        return list(ARMS), {}
    return ["p2pd"], {"tcp": "this SwarmAverager has no transport parameter: hivemind's p2pd path only"}


# ------------------------------------------------------------------------------------------- worker processes


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """One torch thread per process (2 cores here; more threads only contend), unbuffered output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env | (extra or {})


class Child:
    """A worker subprocess in its own session; its stdout is read as JSON lines ``TAG {json}`` in a thread, its
    stderr goes to ``log_path``."""

    def __init__(self, log_path: Path, prefix: list[str] | None = None, env: dict[str, str] | None = None):
        command = [*(prefix or []), sys.executable, "-m", "diloco.bench.allreduce"]
        self.command, self.log_path = shlex.join(command), log_path
        with log_path.open("w") as err:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                env=child_env(env), start_new_session=True,
            )  # fmt: skip
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def expect(self, tag: str, timeout: float = LINE_TIMEOUT_S) -> dict[str, Any]:
        """The payload of the next ``tag`` line, waiting at most ``timeout`` seconds; BenchError (one line: the
        exit code and the last line of the worker's log) otherwise."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                lines = [x for x in self.log_path.read_text(errors="replace").splitlines() if x.strip()]
                last = lines[-1].strip() if lines else "no output"
                raise BenchError(f"a worker exited with code {self.proc.wait()} before {tag}: {last} "
                                 f"(log: {self.log_path})")  # fmt: skip
            if line.startswith(tag + " "):
                return json.loads(line.split(" ", 1)[1])
        raise BenchError(f"a worker sent no {tag} within {timeout:.0f} s (log: {self.log_path})")

    def run(self, role: str, *args: Any) -> None:
        """Start ``role`` with ``args`` in the worker (after the roles sent before)."""
        self.send(json.dumps([role, *args]))

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def family(self) -> list[psutil.Process]:
        """This worker and all its descendants (DHT and averager processes, p2pd), as far as they still run."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


def stop_children(children: list[Child], dhts: Sequence[Any] = (), grace_s: float = 20.0) -> None:
    """Let the workers exit (stdin closed) while ``dhts`` (bootstrap DHTs) shut down, then kill by pid whatever of
    them and their descendants is left.

    hivemind's DHT and averager processes move to process groups of their own, so a killpg of the worker's
    session would miss them: every descendant is collected first and killed by its pid.
    """
    procs = {p.pid: p for child in children for p in child.family()}
    for child in children:
        with contextlib.suppress(OSError):
            child.proc.stdin.close()
    for dht in dhts:
        try:
            dht.shutdown()
        except Exception as e:  # the workers must still be stopped
            log.warning("bench allreduce: a bootstrap DHT did not shut down: %s: %s", type(e).__name__, e)
    _, alive = psutil.wait_procs(list(procs.values()), timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=5)


@dataclass
class Place:
    """Where arms run: ``workers[i]`` is peer i (in namespace ``hosts[i]`` on the shaped link, on loopback when
    ``hosts`` is None); ``dht`` the bootstrap DHT they join, in this process."""

    where: str
    workers: list[Child]
    hosts: list[netns.Host] | None
    dht: Any

    def ip(self, i: int) -> str:
        return self.hosts[i].ip if self.hosts else "127.0.0.1"

    @property
    def initial_peers(self) -> list[str]:
        from diloco import swarm

        return swarm.visible_maddrs(self.dht)


@contextlib.contextmanager
def places(*wanted: tuple[int, list[netns.Host] | None], work_dir: Path) -> Iterator[list[Place]]:
    """Per (count, hosts) of ``wanted``, ``count`` workers (one per namespace of ``hosts``, or on loopback) and a
    bootstrap DHT in this process (on the namespaces' bridge, or on loopback). All start at once, and are ready
    when this yields (a worker importing meanwhile would skew the timings); on leaving, whatever happened, every
    one of them is stopped."""
    from diloco import swarm  # hivemind only here (it forks the bootstrap DHTs from this process)

    made: list[Place] = []
    try:
        for count, hosts in wanted:
            where = "shaped" if hosts else "loopback"
            made.append(Place(where, [], hosts, None))
            for i in range(count):
                env = {"GLOO_SOCKET_IFNAME": hosts[i].iface if hosts else "lo"}
                prefix = hosts[i].prefix() if hosts else None
                made[-1].workers.append(Child(work_dir / f"worker-{where}-{i}.log", prefix, env))
        for at in made:
            bridge = at.hosts[0].ip.rsplit(".", 1)[0] + ".254" if at.hosts else "127.0.0.1"
            at.dht = swarm.start_dht(initial_peers=[], host_maddrs=[f"/ip4/{bridge}/tcp/0"], announce_maddrs=[])
        for at in made:
            for worker in at.workers:
                worker.expect("STARTED", timeout=START_TIMEOUT_S)
        yield made
    finally:
        stop_children([w for at in made for w in at.workers], [at.dht for at in made if at.dht is not None])


def tree_rss_mb(children: list[Child]) -> float:
    """Summed RSS of the workers and their descendants in MiB (shared memory counts in every process that maps
    it: a swarm peer's tensor buffer appears in its caller and in its averager)."""
    total = 0
    for child in children:
        for proc in child.family():
            with contextlib.suppress(psutil.NoSuchProcess):
                total += proc.memory_info().rss
    return total / 2**20


class RssSampler:
    """Samples ``tree_rss_mb(children)`` every SAMPLE_S seconds in a thread; ``stop()`` returns the peak."""

    def __init__(self, children: list[Child]):
        self.children, self.peak_mb = children, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak_mb = max(self.peak_mb, tree_rss_mb(self.children))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mb


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_net() -> int:
    """A second octet N for namespaces at 10.N.0.0/24 that no interface here uses yet."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for net in range(100 + os.getpid() % 50, 250):
        if f" 10.{net}." not in used:
            return net
    raise BenchError("no free 10.N.0.0/24 network for the namespaces")


# ------------------------------------------------------------------------------------------- CPU accounting


def peer_kinds(child: Child) -> dict[int, tuple[str, psutil.Process]]:
    """The processes of one swarm peer by kind: its caller (the worker), the DHT process (the python child that
    runs p2pd), the averager process (the other python child) and p2pd."""
    kinds: dict[int, tuple[str, psutil.Process]] = {}
    for proc in child.family():
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.pid == child.proc.pid:
                kinds[proc.pid] = ("caller", proc)
            elif proc.name() == "p2pd":
                kinds[proc.pid] = ("p2pd", proc)
            elif proc.ppid() == child.proc.pid and proc.name().startswith("python"):
                dht = any(c.name() == "p2pd" for c in proc.children())
                kinds[proc.pid] = ("dht" if dht else "averager", proc)
    return kinds


def cpu_seconds(procs: dict[int, tuple[str, psutil.Process]]) -> dict[int, float]:
    """User + system CPU seconds so far of each process (all its threads)."""
    seconds = {}
    for pid, (_, proc) in procs.items():
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            seconds[pid] = times.user + times.system
    return seconds


def cpu_by_kind(procs: dict[int, tuple[str, psutil.Process]], before: dict[int, float],
                after: dict[int, float]) -> dict[str, float]:  # fmt: skip
    """CPU seconds spent between two snapshots, summed per kind (over all peers)."""
    spent = dict.fromkeys(KINDS, 0.0)
    for pid, (kind, _) in procs.items():
        if pid in before and pid in after:
            spent[kind] += after[pid] - before[pid]
    return spent


# ------------------------------------------------------------------------------------------- the arms


def payload_bytes(size: int) -> int:
    return 4 * size


def mb_s(nbytes: float, seconds: float) -> float:
    """MB/s with MB = 10^6 bytes."""
    return nbytes / seconds / 1e6


def stream_arm(kind: str, nbytes: int, rounds: int, at: Place) -> dict[str, Any]:
    """Push ``nbytes`` one way through one connection, ``rounds`` times, from worker 1 to worker 0: ``kind``
    "socket" (plain TCP) or "p2pd" (one libp2p stream between two hivemind P2P daemons, as hivemind's averager
    sends its bytes). Seconds from the first byte written to the receiver's one-byte acknowledgement of the last;
    MB/s of the best round."""
    receiver, sender = at.workers[0], at.workers[1]
    receiver.run(f"{kind}-receiver", at.ip(0), nbytes, rounds)
    target = receiver.expect("LISTEN", timeout=START_TIMEOUT_S)["at"]
    sender.run(f"{kind}-sender", at.ip(1), target, nbytes, rounds)
    seconds = sender.expect("RESULT")["seconds"]
    for worker in (sender, receiver):
        worker.expect("IDLE")
    best = min(seconds)
    return {"bytes": nbytes, "seconds": seconds, "best_s": best, "mb_s": mb_s(nbytes, best)}


def gloo_arm(size: int, k: int, rounds: int, at: Place) -> dict[str, Any]:
    """``torch.distributed.all_reduce`` (gloo) of one float32 tensor of ``size`` over workers 0..k-1, ``rounds``
    times after a warm-up; per call the slowest rank's seconds (each rank times its call after a barrier)."""
    port = free_port()
    workers = at.workers[:k]
    for rank, worker in enumerate(workers):
        worker.run("gloo", at.ip(0), port, rank, k, size, rounds)
    sampler = RssSampler(workers)
    per_rank = [worker.expect("RESULT")["seconds"] for worker in workers]
    peak = sampler.stop()
    for worker in workers:
        worker.expect("IDLE")
    seconds = [max(column) for column in zip(*per_rank)]
    best = min(seconds)
    return {"seconds": seconds, "best_s": best, "mb_s": mb_s(payload_bytes(size), best), "tree_peak_rss_mb": peak}


def swarm_arm(sizes: tuple[int, ...], arms: list[str], k: int, rounds: int, at: Place) -> list[dict[str, Any]]:
    """Workers 0..k-1 start a DHT peer each (joined to the bootstrap DHT) and, for each size and each transport
    of ``arms`` in turn, a SwarmAverager over one tensor that averages ``rounds`` times. Returns one row per
    (size, transport): every peer's report of every round, CPU seconds by process kind, peak RSS."""
    workers = at.workers[:k]
    cases = [[size, transport] for size in sizes for transport in arms]  # transports alternate: same load for both
    for i, worker in enumerate(workers):
        worker.run("peer", i, k, at.initial_peers, at.ip(i), cases, f"bench-{os.getpid()}-{at.where}-{k}")
    rows = []
    for size, transport in cases:
        sampler = RssSampler(workers)
        row = swarm_case(workers, size, transport, rounds, at.hosts)
        rows.append(row | {"tree_peak_rss_mb": sampler.stop()})
    for worker in workers:
        worker.expect("IDLE", timeout=START_TIMEOUT_S)
    return rows


def swarm_case(children: list[Child], size: int, transport: str, rounds: int, hosts: list[netns.Host] | None
               ) -> dict[str, Any]:  # fmt: skip
    """Release the peers together for each round of one size and transport and collect their reports, the CPU
    seconds their processes spent in the round and (on ``hosts``) the bytes the kernel counted on each peer's veth.
    A round that fails (a peer not ok, or not with all k: a matchmaking split, seen 3 times in about 300 rounds
    under load) is recorded in ``failed_rounds`` and tried again, up to ATTEMPTS times."""
    k = len(children)
    done: list[dict[str, Any]] = []
    failed: list[list[dict]] = []
    for child in children:
        child.expect("READY", timeout=START_TIMEOUT_S)
    while len(done) < rounds:
        attempt = swarm_round(children, hosts)
        reports = attempt["reports"]
        if all(r["ok"] and r["num_peers"] == k for r in reports):
            if len({r["checksum"] for r in reports}) != 1:
                raise BenchError(f"{ARMS[transport]} peers hold different results after a round: {reports}")
            carried = {r.get("transport", transport) for r in reports}  # what carried the bytes, where reported
            if carried != {transport}:
                raise BenchError(f"a {ARMS[transport]} round went over {sorted(carried)}: {reports}")
            done.append(attempt)
            continue
        failed.append(reports)
        log.warning("bench allreduce: a %s round of %d parameters with %d peers failed: %s", ARMS[transport], size,
                    k, reports)  # fmt: skip
        if len(failed) >= ATTEMPTS:
            raise BenchError(f"{len(failed)} {ARMS[transport]} rounds of {size} parameters with {k} peers failed: "
                             f"{json.dumps(failed)}")  # fmt: skip
    for child in children:  # only now: a peer that leaves a round early cuts its replies still on the way
        child.send("next")
    return summarize_swarm(size, k, transport, done) | {"failed_rounds": failed}


def swarm_round(children: list[Child], hosts: list[netns.Host] | None) -> dict[str, Any]:
    """One round: every peer's report, CPU seconds by process kind, per peer (sent, received) veth bytes."""
    procs = {pid: entry for child in children for pid, entry in peer_kinds(child).items()}
    before, counters = cpu_seconds(procs), [host.counters() for host in hosts or []]
    for child in children:
        child.send("go")
    reports = [child.expect("RESULT") for child in children]
    cpu = cpu_by_kind(procs, before, cpu_seconds(procs))
    after = [host.counters() for host in hosts or []]
    wire = [[end - start for start, end in zip(a, b)] for a, b in zip(counters, after)]
    return {"reports": reports, "cpu": cpu, "wire": wire}


def summarize_swarm(size: int, k: int, transport: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round the slowest peer's all-reduce seconds (trigger to result); median over the rounds."""
    reports, cpu, wire = ([r[key] for r in rounds] for key in ("reports", "cpu", "wire"))
    allreduce = [max(r["allreduce_s"] for r in round_reports) for round_reports in reports]
    median = statistics.median(allreduce)
    row = {
        "size": size,
        "peers": k,
        "transport": transport,
        "bytes": payload_bytes(size),
        "allreduce_s": allreduce,
        "median_s": median,
        "mb_s": mb_s(payload_bytes(size), median),
        "round_s": [max(r["round_s"] for r in round_reports) for round_reports in reports],
        "cpu_s": cpu,
        "cpu_s_median": {kind: statistics.median(c[kind] for c in cpu) for kind in KINDS},
        "bytes_sent": [[r["bytes_sent"] for r in round_reports] for round_reports in reports],
        "bytes_received": [[r["bytes_received"] for r in round_reports] for round_reports in reports],
        "reports": reports,
    }
    if wire and wire[0]:
        row["kernel_sent"] = [[w[0] for w in round_wire] for round_wire in wire]
        row["kernel_received"] = [[w[1] for w in round_wire] for round_wire in wire]
    return row


def ideal(size: int, k: int, rate_mbit: float) -> dict[str, Any]:
    """The bandwidth bound of an all-reduce: each peer must send (and receive) 2(k-1)/k of the payload
    (reduce-scatter: (k-1)/k of its values to the other reducers; all-gather: its averaged 1/k to the k-1 others),
    both directions at once on a full-duplex link. Seconds = those bytes ÷ the link rate (rate_mbit 10^6 bit/s)."""
    required = 2 * (k - 1) * payload_bytes(size) / k
    rate = rate_mbit * 1e6 / 8
    return {"required_bytes": required, "link_bytes_per_s": rate, "ideal_s": required / rate}


# ------------------------------------------------------------------------------------------- measure


def loopback(p: Plan, arms: list[str], at: Place) -> dict[str, Any]:
    """References first (socket and p2pd streams of each payload), then per group size the swarm peers over every
    size and transport, then gloo with the same ranks and sizes."""
    streams = {size: stream_arm("socket", payload_bytes(size), p.rounds, at) for size in p.sizes}
    p2pd = {size: stream_arm("p2pd", payload_bytes(size), p.rounds, at) for size in p.sizes}
    rows = []
    for k in p.peers:
        log.info("bench allreduce: loopback, %d peers, sizes %s, transports %s", k, p.sizes, arms)
        swarm = swarm_arm(p.sizes, arms, k, p.rounds, at)
        for size in p.sizes:
            rows.append({
                "size": size, "peers": k, "bytes": payload_bytes(size),
                "arms": {row["transport"]: row for row in swarm if row["size"] == size},
                "gloo": gloo_arm(size, k, p.rounds, at), "socket_stream": streams[size], "p2pd_stream": p2pd[size],
            })  # fmt: skip
    return {"rows": rows}


def shaped(p: Plan, arms: list[str], at: Place) -> dict[str, Any]:
    """The same arms with every peer in its own namespace behind a veth shaped to LINK_MBIT both ways."""
    rows = []
    nbytes = payload_bytes(max(p.shaped_sizes))
    tcp = stream_arm("socket", nbytes, 1, at)
    p2pd = stream_arm("p2pd", nbytes, 1, at)
    for k in p.shaped_peers:
        log.info("bench allreduce: shaped %g Mbit/s, %d peers, sizes %s, transports %s", LINK_MBIT, k,
                 p.shaped_sizes, arms)  # fmt: skip
        swarm = swarm_arm(p.shaped_sizes, arms, k, p.rounds, at)
        for size in p.shaped_sizes:
            bound = ideal(size, k, LINK_MBIT)
            gloo = gloo_arm(size, k, 1, at)
            by_arm = {row["transport"]: row | {"ratio": row["median_s"] / bound["ideal_s"]}
                      for row in swarm if row["size"] == size}  # fmt: skip
            rows.append({
                "size": size, "peers": k, "bytes": payload_bytes(size), **bound, "arms": by_arm,
                "gloo": gloo, "gloo_ratio": gloo["best_s"] / bound["ideal_s"],
            })  # fmt: skip
    return {"rate_mbit": LINK_MBIT, "latency": "none added (the netem qdisc is missing on this kernel)",
            "tcp_stream": tcp, "p2pd_stream": p2pd, "rows": rows}  # fmt: skip


def measure(quick: bool, work_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Loopback arms for every size and group size, then the shaped-link arms (the workers of both start
    together). Returns the result document."""
    p = plan(quick)
    arms, skipped = transports()
    for transport, reason in skipped.items():
        log.warning("bench allreduce: %s not measured: %s", ARMS[transport], reason)
    no_netns = netns.available()
    if no_netns:  # a machine without `ip netns` / `tc` (a lent GPU box): loopback only, and the doc says why
        log.warning("bench allreduce: loopback only, the shaped-link arms need network namespaces: %s", no_netns)
        with places((max(p.peers), None), work_dir=work_dir) as (on_loopback,):
            measured = {"loopback": loopback(p, arms, on_loopback), "shaped": None, "no_shaped": no_netns}
    else:
        count = max(p.shaped_peers)
        with netns.hosts(count, rate_mbit=LINK_MBIT, net=free_net()) as hosts:
            with places((max(p.peers), None), (count, hosts), work_dir=work_dir) as (on_loopback, on_link):
                measured = {"loopback": loopback(p, arms, on_loopback), "shaped": shaped(p, arms, on_link)}
    return {
        "plan": asdict(p),
        "arms": arms,
        "skipped": skipped,
        "timeouts_s": {"matchmaking": MATCHMAKING_S, "averaging": AVERAGING_TIMEOUT_S},
        "target_mb_s": TARGET_MB_S,
        "target_ratio": TARGET_RATIO,
        **measured,
    }


# ------------------------------------------------------------------------------------------- markdown


def markdown(result: dict[str, Any]) -> str:
    """A dated section: machine, command, what was timed, the loopback tables and the shaped-link table."""
    load = f"{result['machine']['load_avg_1m']:.1f} / {result['load_avg_1m_end']:.1f}"
    arms = result["arms"]
    lines = [
        f"## {result['bench']}{' (quick)' if result['quick'] else ''}: {result['date']}",
        "",
        f"- machine: {machine_line(result['machine'])}",
        f"- command: `{result['command']}`",
        f"- 1-minute load average at start / end: {load} (timings follow the load)",
        "- diloco tcp / hivemind p2pd: k peer processes, each its own DHT peer (+ p2pd) joined to one bootstrap DHT, "
        "each a `SwarmAverager(transport=...)` over one float32 tensor, compression none, all released together; "
        "hivemind forms the group either way, then the bytes go over plain TCP sockets (tcp) or libp2p streams "
        "through p2pd (p2pd); **s** = trigger to result (matchmaking excluded; the round with matchmaking in the "
        f"JSON as `round_s`), slowest peer, median over {result['plan']['rounds']} rounds; MB/s per peer = payload "
        "bytes ÷ that time (MB = 10^6 bytes)",
        "- gloo: `torch.distributed.all_reduce` of the same tensor with k ranks, slowest rank, best call; socket / "
        "p2pd stream: the payload's bytes one way through one TCP connection / one libp2p stream between two p2pd "
        "daemons, best round",
        *[f"- {ARMS[t]}: not measured ({why})" for t, why in result["skipped"].items()],
        *(["- quick: payloads this small time start-up and latency, not the transports' rates; the verdicts below "
           "mean something for the full run only"] if result["quick"] else []),  # fmt: skip
        "",
        *loopback_table(result["loopback"]["rows"]),
        "",
        *cpu_table(result["loopback"]["rows"], arms),
        "",
        *(shaped_table(result["shaped"], arms, result["target_ratio"]) if result["shaped"] else
          [f"Shaped link: not measured (it needs network namespaces: {result.get('no_shaped')})."]),  # fmt: skip
        "",
    ]
    for transport in arms:
        best = max(row["arms"][transport]["mb_s"] for row in result["loopback"]["rows"])
        verdict = "meets" if best >= result["target_mb_s"] else "misses"
        lines.append(f"Loopback: best {ARMS[transport]} {best:.0f} MB/s per peer ({verdict} the "
                     f"{result['target_mb_s']:.0f} MB/s target).")  # fmt: skip
    lines += ["", failed_line(result)]
    return "\n".join(lines) + "\n"


def all_rows(result: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, table row, swarm row) for every size, group size and transport measured."""
    for where in ("loopback", "shaped"):
        for row in (result[where] or {"rows": []})["rows"]:
            for swarm in row["arms"].values():
                yield where, row, swarm


def failed_line(result: dict[str, Any]) -> str:
    """How many swarm rounds failed and were run again (left out of the times above)."""
    failed = [f"{where} {ARMS[sw['transport']]} {row['size'] / 1e6:g}M × {row['peers']}: {len(sw['failed_rounds'])}"
              for where, row, sw in all_rows(result) if sw["failed_rounds"]]  # fmt: skip
    if not failed:
        return "Every averaging round completed with all peers at the first attempt."
    return ("Averaging rounds that failed (a peer not ok or not with the whole group) and were run again, left out "
            f"of the times: {'; '.join(failed)} (reports in the JSON, `failed_rounds`).")  # fmt: skip


def cells(row: dict[str, Any], transport: str, *keys: str) -> list[str]:
    """Seconds and MB/s (or ratio) of one transport's row, "–" for a transport not measured."""
    swarm = row["arms"].get(transport)
    if swarm is None:
        return ["–"] * len(keys)
    formats = {"median_s": "{:.2f}", "mb_s": "{:.0f}", "ratio": "{:.2f}"}
    return [formats[key].format(swarm[key]) for key in keys]


def loopback_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| parameters | payload MB | peers | diloco tcp s | diloco tcp MB/s per peer | hivemind p2pd s | "
        "hivemind p2pd MB/s per peer | gloo s | gloo MB/s | p2pd stream MB/s | socket MB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        measured = [*cells(row, "tcp", "median_s", "mb_s"), *cells(row, "p2pd", "median_s", "mb_s")]
        gloo = row["gloo"]
        lines.append(
            f"| {row['size'] / 1e6:g}M | {row['bytes'] / 1e6:.0f} | {row['peers']} | {' | '.join(measured)} | "
            f"{gloo['best_s']:.2f} | {gloo['mb_s']:.0f} | {row['p2pd_stream']['mb_s']:.0f} | "
            f"{row['socket_stream']['mb_s']:.0f} |"
        )
    return lines


def cpu_table(rows: list[dict[str, Any]], arms: list[str]) -> list[str]:
    """Where a round's time goes: CPU seconds of each process kind, all peers summed, median round."""
    lines = [
        "CPU seconds per averaging round on loopback, all peers summed (median round), and peak RSS of all peer "
        "processes (shared tensor buffers counted twice):",
        "",
        "| parameters | peers | transport | round s | averager CPU s | p2pd CPU s | DHT CPU s | caller CPU s | "
        "peak RSS MB |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for transport in arms:
            sw = row["arms"][transport]
            cpu = sw["cpu_s_median"]
            lines.append(
                f"| {row['size'] / 1e6:g}M | {row['peers']} | {ARMS[transport]} | {sw['median_s']:.2f} | "
                f"{cpu['averager']:.2f} | {cpu['p2pd']:.2f} | {cpu['dht']:.2f} | {cpu['caller']:.2f} | "
                f"{sw['tree_peak_rss_mb']:.0f} |"
            )
    return lines


def kernel_mb(row: dict[str, Any], transport: str) -> str:
    """Median over peers and rounds of the bytes a peer's veth carried out during a round, MB."""
    swarm = row["arms"].get(transport)
    if swarm is None:
        return "–"
    return f"{statistics.median(v for per_round in swarm['kernel_sent'] for v in per_round) / 1e6:.0f}"


def shaped_table(sh: dict[str, Any], arms: list[str], target: float) -> list[str]:
    lines = [
        f"Shaped link: each peer in its own network namespace, its veth shaped with `tc tbf` to {sh['rate_mbit']:g} "
        f"Mbit/s both ways; latency: {sh['latency']}. One TCP stream across it moves {sh['tcp_stream']['mb_s']:.0f} "
        f"MB/s, one p2pd stream {sh['p2pd_stream']['mb_s']:.0f} MB/s. Ideal = 2(k−1)/k × payload (what each peer "
        "must send, and receive, in a bandwidth-optimal all-reduce) ÷ link rate; ratio = measured ÷ ideal; kernel "
        "MB out = bytes the peer's veth carried out during the round (headers, framing and DHT traffic included), "
        "median over peers and rounds.",
        "",
        "| parameters | peers | required MB out | ideal s | diloco tcp s | ratio | hivemind p2pd s | ratio | "
        "gloo s | gloo ratio | kernel MB out tcp / p2pd |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in sh["rows"]:
        measured = [*cells(row, "tcp", "median_s", "ratio"), *cells(row, "p2pd", "median_s", "ratio")]
        lines.append(
            f"| {row['size'] / 1e6:g}M | {row['peers']} | {row['required_bytes'] / 1e6:.0f} | {row['ideal_s']:.2f} | "
            f"{' | '.join(measured)} | {row['gloo']['best_s']:.2f} | {row['gloo_ratio']:.2f} | "
            f"{kernel_mb(row, 'tcp')} / {kernel_mb(row, 'p2pd')} |"
        )
    lines.append("")
    for transport in arms:
        worst = max(row["arms"][transport]["ratio"] for row in sh["rows"])
        verdict = "meets" if worst <= target else "misses"
        lines.append(f"Shaped: worst {ARMS[transport]} ratio {worst:.2f} ({verdict} the ≤ {target} target).")
    return lines


# ------------------------------------------------------------------------------------------- worker roles


def emit(tag: str, payload: dict[str, Any]) -> None:
    print(f"{tag} {json.dumps(payload)}", flush=True)


def socket_receiver(address: str, nbytes: int, rounds: int) -> None:
    """Accept one connection per round, read ``nbytes`` into one buffer, acknowledge with one byte."""
    buffer = memoryview(bytearray(min(nbytes, CHUNK)))
    with socket.create_server((address, 0)) as server:
        emit("LISTEN", {"at": f"{address}:{server.getsockname()[1]}"})
        for _ in range(rounds):
            conn, _ = server.accept()
            with conn:
                left = nbytes
                while left:
                    got = conn.recv_into(buffer, min(left, len(buffer)))
                    if not got:
                        raise ConnectionError("sender closed early")
                    left -= got
                conn.sendall(b"k")


def socket_sender(_address: str, target: str, nbytes: int, rounds: int) -> None:
    """Send ``nbytes`` per round to ``target`` (host:port) from a CHUNK-byte buffer; seconds from the first byte
    to the acknowledgement."""
    host, port = target.rsplit(":", 1)
    buffer = memoryview(bytearray(os.urandom(min(nbytes, CHUNK))))
    seconds = []
    for _ in range(rounds):
        with socket.create_connection((host, int(port))) as conn:
            started = time.perf_counter()
            left = nbytes
            while left:
                chunk = buffer[: min(left, len(buffer))]
                conn.sendall(chunk)
                left -= len(chunk)
            if conn.recv(1) != b"k":
                raise ConnectionError("no acknowledgement")
            seconds.append(time.perf_counter() - started)
    emit("RESULT", {"seconds": seconds})


async def p2pd_receiver(address: str, nbytes: int, rounds: int) -> None:
    """A hivemind P2P daemon with one stream handler: per stream, read ``nbytes`` and acknowledge with one byte."""
    from hivemind.p2p import P2P

    p2p = await P2P.create(host_maddrs=[f"/ip4/{address}/tcp/0"])
    served = asyncio.Queue()

    async def handle(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        left = nbytes
        while left:
            data = await reader.read(min(left, CHUNK))
            if not data:
                raise ConnectionError("sender closed early")
            left -= len(data)
        writer.write(b"k")
        await writer.drain()
        served.put_nowait(None)

    try:
        await p2p.add_binary_stream_handler("bench-push", handle)
        emit("LISTEN", {"at": str((await p2p.get_visible_maddrs())[0])})
        for _ in range(rounds):
            await served.get()
        await asyncio.sleep(0.5)  # let the last acknowledgement leave
    finally:
        await p2p.shutdown()


async def p2pd_sender(address: str, maddr: str, nbytes: int, rounds: int) -> None:
    """A second daemon that opens one stream per round to the receiver and writes ``nbytes`` in CHUNK-byte
    writes; seconds from the first write to the acknowledgement."""
    from hivemind.p2p import P2P, PeerID

    p2p = await P2P.create(initial_peers=[maddr], host_maddrs=[f"/ip4/{address}/tcp/0"])
    buffer = memoryview(bytearray(os.urandom(min(nbytes, CHUNK))))
    seconds = []
    try:
        for _ in range(rounds):
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(maddr.rsplit("/", 1)[1]),
                                                                     "bench-push")  # fmt: skip
            started = time.perf_counter()
            left = nbytes
            while left:
                writer.write(buffer[: min(left, len(buffer))])
                await writer.drain()
                left -= min(left, len(buffer))
            if await reader.readexactly(1) != b"k":
                raise ConnectionError("no acknowledgement")
            seconds.append(time.perf_counter() - started)
            writer.close()
        emit("RESULT", {"seconds": seconds})
    finally:
        await p2p.shutdown()


def gloo_rank(master: str, port: int, rank: int, world: int, size: int, rounds: int) -> None:
    """One gloo rank: a warm-up all_reduce, then ``rounds`` timed all_reduce calls of ``size`` float32 values."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world)
    try:
        tensor = torch.randn(size, generator=torch.Generator().manual_seed(rank))
        dist.all_reduce(torch.ones(1024))
        seconds = []
        for _ in range(rounds):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(tensor)
            seconds.append(time.perf_counter() - started)
        emit("RESULT", {"seconds": seconds})
    finally:
        dist.destroy_process_group()


def swarm_peer(index: int, k: int, initial_peers: list[str], ip: str, cases: list[list], prefix: str) -> None:
    """One worker group's averager: a DHT peer, then for each [size, transport] of ``cases`` a SwarmAverager over
    one tensor, READY, then per ``go`` on stdin one round and RESULT (its report, seconds from entering the round
    and from the trigger to the result, a checksum that bit-identical results share), until ``next``.

    The bench says ``next`` once every peer has its result: a peer whose own outputs are complete may still be
    sending the averages of its part to a groupmate, and shutting its averager down then fails that groupmate's
    round (seen: "received 99.9% results" on the last round of a size).
    """
    import torch

    from diloco import swarm

    dht = swarm.start_dht(initial_peers=initial_peers, host_maddrs=[f"/ip4/{ip}/tcp/0"], announce_maddrs=[])
    try:
        for size, transport in cases:
            tensor = torch.randn(size, generator=torch.Generator().manual_seed(index))
            # a group with any p2pd member averages over libp2p: each transport gets a key of its own
            with timed_averager_class()(
                dht, prefix=f"{prefix}-{transport}-{size}", tensors=[tensor], compression="none",
                matchmaking_time=MATCHMAKING_S, averaging_timeout=AVERAGING_TIMEOUT_S, target_group_size=k,
                **transport_kwargs(transport),
            ) as averager:  # fmt: skip
                emit("READY", {"size": size, "transport": transport})
                for round_index in itertools.count():
                    command = sys.stdin.readline().strip()
                    if command == "next":
                        break
                    if command != "go":
                        raise SystemExit(1)  # the bench is gone or out of step
                    averager.triggered_at = None
                    started = time.monotonic()
                    report = averager.average([tensor], round_index=round_index)
                    finished = time.monotonic()
                    if averager.triggered_at is None and report.ok and report.num_peers > 1:
                        raise RuntimeError("SwarmAverager no longer calls _trigger_when_grouped: the bench cannot "
                                           "tell the all-reduce from matchmaking")  # fmt: skip
                    triggered = averager.triggered_at or started
                    emit("RESULT", asdict(report) | {"round_s": finished - started, "allreduce_s": finished - triggered,
                                                     "checksum": float(tensor.sum())})  # fmt: skip
    finally:
        dht.shutdown()


def transport_kwargs(transport: str) -> dict[str, str]:
    """``transport=`` for a SwarmAverager that has the parameter; none for one that only has hivemind's p2pd path."""
    from diloco.swarm import SwarmAverager

    if "transport" in inspect.signature(SwarmAverager).parameters:
        return {"transport": transport}
    if transport != "p2pd":
        raise ValueError(f"this SwarmAverager has no transport {transport!r}")
    return {}


def timed_averager_class() -> type:
    """SwarmAverager that records (``triggered_at``, monotonic seconds) when it let the all-reduce start: the
    group had formed, matchmaking is over."""
    from diloco.swarm import SwarmAverager

    class TimedAverager(SwarmAverager):
        triggered_at: float | None = None

        def _trigger_when_grouped(self, control, give_up_at, stop):  # type: ignore[override]
            grouped = SwarmAverager._trigger_when_grouped(control, give_up_at, stop)
            self.triggered_at = time.monotonic()
            return grouped

    return TimedAverager


def exit_with_parent() -> None:
    """Exit this worker (``os._exit``) as soon as the bench that started it is gone, whatever it is doing: a
    bench killed mid-round must not leave peers behind (their DHT, averager and p2pd follow them)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


ROLES = {
    "socket-receiver": socket_receiver,
    "socket-sender": socket_sender,
    "p2pd-receiver": lambda *args: asyncio.run(p2pd_receiver(*args)),
    "p2pd-sender": lambda *args: asyncio.run(p2pd_sender(*args)),
    "gloo": gloo_rank,
    "peer": swarm_peer,
}


def worker() -> None:
    """``python -m diloco.bench.allreduce``: import what every role needs, say STARTED, then run the roles read
    from stdin (``[role, *args]`` as JSON) one after another, each followed by IDLE, until stdin closes (exit
    code 0). A role that fails ends the worker with its traceback in the log and exit code 1."""
    exit_with_parent()
    import hivemind.p2p  # noqa: F401  (hivemind imports torch)
    import torch
    import torch.distributed  # noqa: F401

    import diloco.swarm  # noqa: F401

    torch.set_num_threads(1)
    emit("STARTED", {})
    while line := sys.stdin.readline():
        role, *args = json.loads(line)
        ROLES[role](*args)
        emit("IDLE", {})
    os._exit(0)  # every role has stopped what it started; the interpreter's teardown would take seconds


if __name__ == "__main__":
    worker()

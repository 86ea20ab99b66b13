"""`diloco bench allreduce`: the time of one averaging round of the swarm averager (``diloco.swarm``) against what
the machine and the link allow, for both of its transports: "diloco tcp" (hivemind forms the group, the tensor bytes
go over plain TCP sockets between the groupmates, ``diloco.swarm.rounds.tcp``) and "hivemind p2pd" (hivemind's own path:
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

Every process that measures is a worker subprocess of this one (``diloco.bench.allreduce_worker``, which runs the
roles), one per peer (on the shaped link: in that peer's namespace), in a session of its own; this module plans the
arms, sends the workers their roles and reads their answers. The report is ``diloco.bench.allreduce_report``.

A round's time is what ``SwarmAverager`` reports (``RoundReport.seconds``), matchmaking included: its public API
does not say when the group formed (see ``allreduce_worker.swarm_peer``).
"""

from __future__ import annotations

import contextlib
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

from diloco import procs
from diloco.bench import BenchError, netns
from diloco.bench.allreduce_report import ARMS, CARRIER, markdown
from diloco.bench.allreduce_worker import AVERAGING_TIMEOUT_S, MATCHMAKING_S

__all__ = ["markdown", "measure", "stem"]  # `diloco.bench.run` calls them on this module

log = logging.getLogger("diloco")

FULL_SIZES = (10_000_000, 50_000_000, 150_000_000)  # float32 parameters
QUICK_SIZES = (250_000,)  # 1 MB: the quick run checks the machinery, not the rates
# 4 MB on the shaped link: tbf lets its 125 kB bucket through at once, a 3% head start at this size (12% at 1 MB,
# and the quick test checks that nothing beats the link by more than 5%)
QUICK_SHAPED_SIZES = (1_000_000,)
LINK_MBIT = 1000.0  # tbf rate of every veth in the shaped runs, 10^6 bit/s
TARGET_MB_S = 1000.0  # loopback goal, MB/s per peer
TARGET_RATIO = 1.3  # shaped-link goal, measured ÷ ideal
ATTEMPTS = 3  # failed rounds tolerated per size and transport before the bench gives up
START_TIMEOUT_S = 120.0  # longest wait for a worker's imports, a DHT or an averager to start
LINE_TIMEOUT_S = 600.0  # longest wait for one line of a worker (one round, one stream)
SAMPLE_S = 0.2  # RSS sampling period while workers run
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


# ------------------------------------------------------------------------------------------- worker processes


class Child:
    """A worker subprocess in its own session; its stdout is read as JSON lines ``TAG {json}`` in a thread, its
    stderr goes to ``log_path``."""

    def __init__(self, log_path: Path, prefix: list[str] | None = None, env: dict[str, str] | None = None):
        command = [*(prefix or []), sys.executable, "-m", "diloco.bench.allreduce_worker"]
        self.command, self.log_path = shlex.join(command), log_path
        with log_path.open("w") as err:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                env=procs.child_env(threads=1, **(env or {})), start_new_session=True,
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
        return procs.family(self.proc.pid)


def stop_children(children: list[Child], dhts: Sequence[Any] = (), grace_s: float = 20.0) -> None:
    """Let the workers exit (stdin closed) while ``dhts`` (bootstrap DHTs) shut down, then kill by pid whatever of
    them and their descendants is left.

    hivemind's DHT and averager processes move to process groups of their own, so a killpg of the worker's
    session would miss them: every descendant is collected first and killed by its pid (``procs.kill_all``).
    """
    running = [p for child in children for p in child.family()]
    for child in children:
        with contextlib.suppress(OSError):
            child.proc.stdin.close()
    for dht in dhts:
        try:
            dht.shutdown()
        except Exception as e:  # noqa: BLE001 - the workers must still be stopped
            log.warning("bench allreduce: a bootstrap DHT did not shut down: %s: %s", type(e).__name__, e)
    procs.kill_all(running, grace_s)
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
        from diloco.swarm.records.dht import visible_maddrs

        return visible_maddrs(self.dht)


@contextlib.contextmanager
def places(*wanted: tuple[int, list[netns.Host] | None], work_dir: Path) -> Iterator[list[Place]]:
    """Per (count, hosts) of ``wanted``, ``count`` workers (one per namespace of ``hosts``, or on loopback) and a
    bootstrap DHT in this process (on the namespaces' bridge, or on loopback). All start at once, and are ready
    when this yields (a worker importing meanwhile would skew the timings); on leaving, whatever happened, every
    one of them is stopped."""
    # hivemind only here (it forks the bootstrap DHTs from this process)
    from diloco.swarm.records.dht import start_dht

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
            at.dht = start_dht(initial_peers=[], host_maddrs=[f"/ip4/{bridge}/tcp/0"], announce_maddrs=[])
        for at in made:
            for worker in at.workers:
                worker.expect("STARTED", timeout=START_TIMEOUT_S)
        yield made
    finally:
        stop_children([w for at in made for w in at.workers], [at.dht for at in made if at.dht is not None])


class RssSampler:
    """Samples the summed RSS of ``children`` and their descendants (``procs.tree_rss_mb``: shared memory counts in
    every process that maps it, so a swarm peer's tensor buffer appears in its caller and in its averager) every
    SAMPLE_S seconds in a thread, from its start (a quick case can end within one period); ``stop()`` returns the
    peak in MiB. With ``pss``, it also keeps the peak of their summed PSS (shared pages counted once), ``peak_pss_mb``.
    """

    def __init__(self, children: list[Child], pss: bool = False):
        self.children, self.pss, self.peak_mb, self.peak_pss_mb = children, pss, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            pids = [child.proc.pid for child in self.children]
            self.peak_mb = max(self.peak_mb, procs.tree_rss_mb(pids))
            if self.pss:
                self.peak_pss_mb = max(self.peak_pss_mb, procs.tree_pss_mb(pids))
            if self._stop.wait(SAMPLE_S):
                return

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mb


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def cpu_seconds(kinds: dict[int, tuple[str, psutil.Process]]) -> dict[int, float]:
    """User + system CPU seconds so far of each process (all its threads)."""
    seconds = {}
    for pid, (_, proc) in kinds.items():
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            seconds[pid] = times.user + times.system
    return seconds


def cpu_by_kind(kinds: dict[int, tuple[str, psutil.Process]], before: dict[int, float],
                after: dict[int, float]) -> dict[str, float]:  # fmt: skip
    """CPU seconds spent between two snapshots, summed per kind (over all peers)."""
    spent = dict.fromkeys(KINDS, 0.0)
    for pid, (kind, _) in kinds.items():
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
        rss = sampler.stop()
        # what a peer holds for the case (its tensor, the averager's copies, buffers of the round) ÷ the payload
        held = (row["tree_peak_pss_mb"] - row.pop("pss_before_mb")) * 2**20 / k / payload_bytes(size)
        rows.append(row | {"tree_peak_rss_mb": rss, "held_per_payload": held})
    for worker in workers:
        worker.expect("IDLE", timeout=START_TIMEOUT_S)
    return rows


def swarm_case(children: list[Child], size: int, transport: str, rounds: int, hosts: list[netns.Host] | None
               ) -> dict[str, Any]:  # fmt: skip
    """Release the peers together for each round of one size and transport and collect their reports, the CPU
    seconds their processes spent in the round and (on ``hosts``) the bytes the kernel counted on each peer's veth.
    A round that fails (a peer not ok, or not with all k: a matchmaking split, seen 3 times in about 300 rounds
    under load) is recorded in ``failed_rounds`` and tried again, up to ATTEMPTS times. Then one more, untimed
    round, during which the peers' summed PSS is sampled (``tree_peak_pss_mb``)."""
    k = len(children)
    done: list[dict[str, Any]] = []
    failed: list[list[dict]] = []
    before = sum(child.expect("READY", timeout=START_TIMEOUT_S)["pss_before_mb"] for child in children)
    while len(done) < rounds:
        attempt = swarm_round(children, hosts)
        reports = attempt["reports"]
        if all(r["ok"] and r["num_peers"] == k for r in reports):
            if len({r["checksum"] for r in reports}) != 1:
                raise BenchError(f"{ARMS[transport]} peers hold different results after a round: {reports}")
            carried = {r.get("transport", transport) for r in reports}  # what carried the bytes, where reported
            if carried != {CARRIER.get(transport, transport)}:
                raise BenchError(f"a {ARMS[transport]} round went over {sorted(carried)}: {reports}")
            done.append(attempt)
            continue
        failed.append(reports)
        log.warning("bench allreduce: a %s round of %d parameters with %d peers failed: %s", ARMS[transport], size,
                    k, reports)  # fmt: skip
        if len(failed) >= ATTEMPTS:
            raise BenchError(f"{len(failed)} {ARMS[transport]} rounds of {size} parameters with {k} peers failed: "
                             f"{json.dumps(failed)}")  # fmt: skip
    # what the peers hold is sampled in one more round, not timed: reading a PSS walks the process's page tables,
    # and every SAMPLE_S over 600 MB tensors that took 20-40% of the rounds' throughput on a 2-core host
    sampler = RssSampler(children, pss=True)
    swarm_round(children, hosts)
    sampler.stop()
    for child in children:  # only now: a peer that leaves a round early cuts its replies still on the way
        child.send("next")
    return summarize_swarm(size, k, transport, done) | {"failed_rounds": failed, "pss_before_mb": before,
                                                        "tree_peak_pss_mb": sampler.peak_pss_mb}


def swarm_round(children: list[Child], hosts: list[netns.Host] | None) -> dict[str, Any]:
    """One round: every peer's report, CPU seconds by process kind, per peer (sent, received) veth bytes."""
    kinds = {pid: entry for child in children for pid, entry in peer_kinds(child).items()}
    before, counters = cpu_seconds(kinds), [host.counters() for host in hosts or []]
    for child in children:
        child.send("go")
    reports = [child.expect("RESULT") for child in children]
    cpu = cpu_by_kind(kinds, before, cpu_seconds(kinds))
    after = [host.counters() for host in hosts or []]
    wire = [[end - start for start, end in zip(a, b)] for a, b in zip(counters, after)]
    return {"reports": reports, "cpu": cpu, "wire": wire}


def summarize_swarm(size: int, k: int, transport: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round the slowest peer's all-reduce seconds (``RoundReport.allreduce_seconds``: the group's forming to the
    result); median over the rounds."""
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


def stem(quick: bool, arms: list[str] | None = None) -> str:
    """The JSON's name: a run of some arms only does not replace the run of all."""
    return "allreduce" + ("-" + "+".join(arms) if arms else "") + ("-quick" if quick else "")


def measure(quick: bool, work_dir: Path, info: dict[str, Any], arms: list[str] | None = None) -> dict[str, Any]:
    """Loopback arms for every size and group size, then the shaped-link arms (the workers of both start
    together). `arms`: those of ``ARMS`` to run (default all). Returns the result document."""
    p = plan(quick)
    arms = arms or list(ARMS)  # every SwarmAverager transport, and the trainer's rounds of whole groups
    no_netns = netns.available()
    if no_netns:  # a machine without `ip netns` / `tc` (a lent GPU box): loopback only, and the doc says why
        log.warning("bench allreduce: loopback only, the shaped-link arms need network namespaces: %s", no_netns)
        with places((max(p.peers), None), work_dir=work_dir) as (on_loopback,):
            measured = {"loopback": loopback(p, arms, on_loopback), "shaped": None, "no_shaped": no_netns}
    else:
        count = max(p.shaped_peers)
        with netns.hosts(count, rate_mbit=LINK_MBIT) as hosts:
            with places((max(p.peers), None), (count, hosts), work_dir=work_dir) as (on_loopback, on_link):
                measured = {"loopback": loopback(p, arms, on_loopback), "shaped": shaped(p, arms, on_link)}
    return {
        "plan": asdict(p),
        "arms": arms,
        "skipped": {},  # transports not measured, and why: none since every SwarmAverager has both
        "timeouts_s": {"matchmaking": MATCHMAKING_S, "averaging": AVERAGING_TIMEOUT_S},
        "target_mb_s": TARGET_MB_S,
        "target_ratio": TARGET_RATIO,
        **measured,
    }

"""`diloco bench nat`: rounds through home routers, two swarms one after the other.

- **outbound**: the bootstrap peer and a 1-rank group sit on a public bridge; a 1-rank group and a 2-rank FULL_SHARD
  group sit behind home routers of their own doing NAT (``bench.routers``: nftables masquerade, nothing forwarded
  in), each router's uplink shaped to `tc tbf` 100 Mbit/s both ways. The homes' ranks find at join that nobody can
  dial them and dial out only; the public group reduces everything.
- **relayed**: the same two homes and no public group; the bootstrap peer relays (``diloco dht --relay-ports``).
  Nobody can dial anyone: each home's ranks lease ports at the relay and are dialled there, and every byte of a round
  crosses the relay (its own link is not shaped).

Every group starts with the same flags a user gives (no flag about routers). Per group, from its rows: how it
reached the others (``direct``, ``outbound only`` or ``relayed``, as its log says), the bytes of each round that
every group took part in (the group's ranks together), and the round's time on the wire (``averaging_s`` −
``wait_s``: from the group formed to the average held). The *ideal* of a home group's round is its bytes over its
uplink, the larger direction of the two (tbf shapes each direction on its own, so sending and receiving overlap); the
public group's link is not shaped, and its round lasts as long as the slowest home's. The ratio of the swarm's median
round to the largest ideal says what the paths cost beyond the bandwidth.
"""

from __future__ import annotations

import re
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from diloco import procs
from diloco.bench import BenchError
from diloco.bench.hetero import read_rows
from diloco.bench.models import model_folder
from diloco.bench.routers import routed
from diloco.bench.wire import dht_peers, start_dht, started, summary, wait_all

__all__ = ["markdown", "measure"]

UPLINK_MBIT = 100.0
GROUPS = (("public", 1), ("home 1", 1), ("home 2", 2))  # (where, ranks); the homes are behind routers
RELAY_PORTS = "41000-41015"


def setup(quick: bool) -> dict[str, Any]:
    """Quick: a 0.9M model, 2 rounds. Full: a 14M model (56 MB of float32 per round and direction), 6 rounds."""
    if quick:
        return {"model": "llama-2m-fresh", "steps": 8, "local_steps": 4, "batch": 2, "seq_length": 32,
                "timeout_s": 300.0}  # fmt: skip
    return {"model": "llama-14m-fresh", "steps": 30, "local_steps": 5, "batch": 2, "seq_length": 64,
            "timeout_s": 1500.0}  # fmt: skip


def command(s: dict[str, Any], model: Path, run_dir: Path, peers: list[str], world_rank: int, ranks: int,
            galaxy: int) -> list[str]:  # fmt: skip
    launch = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={ranks}"]
    return [
        *launch, "-m", "diloco.train", "--path-model", str(model), "--fake-data", "--seq-length", str(s["seq_length"]),
        "--per-device-train-batch-size", str(s["batch"] // ranks), "--total-batch-size", str(s["batch"]),
        "--max-steps", str(s["steps"]), "--log-interval", "1", "--no-torch-compile", "--precision", "32-true",
        "--metric-logger-type", "dummy", "--run-dir", str(run_dir), "--hv.galaxy-size", str(galaxy),
        "--hv.world-rank", str(world_rank), "--hv.pace", "fixed", "--hv.local-steps", str(s["local_steps"]),
        "--hv.initial-peers", *peers,
    ]  # fmt: skip


def measure(quick: bool, work_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    s = setup(quick)
    model = model_folder(s["model"], work_dir / "models")
    outbound = swarm(s, model, work_dir / "outbound", GROUPS, [])
    relayed = swarm(s, model, work_dir / "relayed", GROUPS[1:], ["--relay-ports", RELAY_PORTS])
    return {"setup": s, "uplink_mbit": UPLINK_MBIT, **outbound, "relayed": relayed}


def swarm(s: dict[str, Any], model: Path, work_dir: Path, groups: tuple[tuple[str, int], ...],
          dht_flags: list[str]) -> dict[str, Any]:  # fmt: skip
    """One swarm: the homes of `groups` behind routers, the others on the public bridge; its figures."""
    public = sum(where == "public" for where, _ in groups)
    runs = [work_dir / f"g{i}" for i in range(len(groups))]
    work_dir.mkdir(parents=True, exist_ok=True)
    with routed(public=1 + public, homes=2, uplink_mbit=UPLINK_MBIT) as topology, ExitStack() as stack:
        bootstrap = topology.public[0]
        dht_log = work_dir / "dht.log"
        dht = start_dht(stack, bootstrap, dht_log, *dht_flags)
        peers = [m for m in dht_peers(dht, dht_log) if f"/ip4/{bootstrap.ip}/" in m]
        hosts = [*topology.public[1:], *(home.host for home in topology.homes)]
        made = [h.name for h in topology.public] + [h.name for home in topology.homes for h in (home.host, home.router)]
        jobs = []
        for i, ((where, ranks), host) in enumerate(zip(groups, hosts)):
            log_path = work_dir / f"g{i}.log"
            cmd = [*host.prefix(), *command(s, model, runs[i], peers, i, ranks, len(groups))]
            env = procs.child_env(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
            jobs.append((f"group {i} ({where})", started(stack, cmd, log_path, env), log_path))
        wait_all(jobs, s["timeout_s"])
        finals = [summary(d) for d in runs]
        if len({f["params_sha256"] for f in finals}) != 1:
            raise BenchError(f"the groups ended on different models, see {work_dir}")
        figures = [group_figures(where, ranks, read_rows(d), log_path.read_text(errors="replace"), len(groups))
                   for (where, ranks), d, (_, _, log_path) in zip(groups, runs, jobs)]  # fmt: skip
    return {"namespaces": made, "groups": figures, **swarm_figures(figures)}


def group_figures(where: str, ranks: int, rows: list[dict[str, Any]], log: str, groups: int) -> dict[str, Any]:
    full = {r["outer_step"]: r for r in rows if r.get("num_peers") == groups}
    if not full:
        raise BenchError(f"the {where} group took part in no round with every group")
    said = set(re.findall(r"can be dialled(?: through a relay)?: (\w+)|cannot be dialled", log))  # ("": the latter)
    path = {frozenset({"direct"}): "direct", frozenset({""}): "outbound only",
            frozenset({"relayed"}): "relayed"}.get(frozenset(said), "mixed")  # fmt: skip
    wire = {step: r["averaging_s"] - r["wait_s"] for step, r in full.items()}
    sent = statistics.median(r["bytes_sent"] for r in full.values())
    received = statistics.median(r["bytes_received"] for r in full.values())
    inbound = statistics.median(r["bytes_inbound"] for r in full.values())
    relayed = statistics.median(r.get("bytes_relayed", 0) for r in full.values())
    ideal = None if where == "public" else max(sent, received) * 8 / (UPLINK_MBIT * 1e6)
    return {"where": where, "ranks": ranks, "path": path, "full_rounds": len(full),
            "rounds": sum(1 for r in rows if "num_peers" in r), "round_wire_s": wire,
            "median_wire_s": statistics.median(wire.values()), "bytes_sent": sent, "bytes_received": received,
            "bytes_inbound": inbound, "bytes_relayed": relayed, "ideal_s": ideal}  # fmt: skip


def swarm_figures(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The swarm's round: per outer step every group took part in, the longest group's time on the wire."""
    shared = set.intersection(*(set(g["round_wire_s"]) for g in groups))
    rounds = [max(g["round_wire_s"][step] for g in groups) for step in sorted(shared)]
    ideal = max(g["ideal_s"] for g in groups if g["ideal_s"] is not None)
    median = statistics.median(rounds) if rounds else None
    return {"swarm_rounds": len(rounds), "median_round_s": median, "ideal_round_s": ideal,
            "round_vs_ideal": None if median is None else median / ideal}  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    from diloco.bench import machine_line

    s = result["setup"]
    load = f"{result['machine']['load_avg_1m']:.1f} / {result['load_avg_1m_end']:.1f}"
    lines = [
        f"## {result['bench']}{' (quick)' if result['quick'] else ''}: {result['date']}", "",
        f"- machine: {machine_line(result['machine'])}; 1-minute load average at start / end: {load}",
        f"- command: `{result['command']}`",
        f"- model {s['model']}, fake data, {s['batch']} sequences of {s['seq_length']} per inner step and group, "
        f"{s['steps']} inner steps, H = {s['local_steps']} (fixed), `--hv.compression none` (float32), no flag about "
        "routers",
        f"- network namespaces: a 1-rank group and a 2-rank FULL_SHARD group each behind a home router of its own "
        f"(nftables masquerade, nothing forwarded in, both homes 192.168.1.0/24), the router's uplink `tc tbf` "
        f"{result['uplink_mbit']:g} Mbit/s each way; `diloco dht` on a public bridge. Two swarms: **outbound** (a "
        f"public 1-rank group beside the homes) and **relayed** (no public group; `diloco dht --relay-ports "
        f"{RELAY_PORTS}`, its link not shaped)",
        "- per group: its path (what its ranks learnt at join), median bytes per round (all its ranks; of which "
        "over connections other groups opened to it, and of which through the relay), median time on the wire per "
        "round (formed to averaged), and the ideal: the larger direction's bytes over the uplink",
    ]
    for name, figures in (("outbound", result), ("relayed", result.get("relayed"))):
        if figures:
            lines += ["", f"**{name}**", "", *table(figures)]
    return "\n".join(lines) + "\n"


def table(figures: dict[str, Any]) -> list[str]:
    lines = [
        "| group | ranks | path | full rounds | sent / round | received / round | of which others dialled | of which "
        "relayed | on the wire | ideal |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for g in figures["groups"]:
        ideal = "—" if g["ideal_s"] is None else f"{g['ideal_s']:.2f} s"
        keys = ("bytes_sent", "bytes_received", "bytes_inbound", "bytes_relayed")
        mb = [f"{g.get(key, 0) / 1e6:.1f} MB" for key in keys]
        lines.append(f"| {g['where']} | {g['ranks']} | {g['path']} | {g['full_rounds']} of {g['rounds']} | "
                     f"{' | '.join(mb)} | {g['median_wire_s']:.2f} s | {ideal} |")  # fmt: skip
    ratio = figures["round_vs_ideal"]
    lines += ["", f"The swarm's median round on the wire: {figures['median_round_s']:.2f} s over "
              f"{figures['swarm_rounds']} rounds, **{ratio:.2f}×** the ideal {figures['ideal_round_s']:.2f} s of the "
              "slowest home."]  # fmt: skip
    return lines

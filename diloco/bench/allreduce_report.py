"""The report of `diloco bench allreduce`: its dated markdown section (setup, the loopback, CPU and shaped-link
tables, the verdicts against the targets) from the result document ``diloco.bench.allreduce.measure`` wrote."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

from diloco.bench import section_head

# SwarmAverager transport -> name in the tables; "groups": the trainer's rounds of whole groups over tcp;
# "groups-keyed": the same in a keyed swarm (every part and average sealed)
ARMS = {"tcp": "diloco tcp", "p2pd": "hivemind p2pd", "groups": "diloco groups", "groups-p2pd": "diloco groups p2pd",
        "groups-keyed": "diloco groups keyed"}  # fmt: skip
# what carries an arm's bytes, where it is not the arm's name
CARRIER = {"groups": "tcp", "groups-p2pd": "p2pd", "groups-keyed": "tcp"}


def markdown(result: dict[str, Any]) -> str:
    """A dated section: machine, command, what was timed, the loopback tables and the shaped-link table."""
    load = f"{result['machine']['load_avg_1m']:.1f} / {result['load_avg_1m_end']:.1f}"
    arms = result["arms"]
    lines = [
        *section_head(result),
        f"- 1-minute load average at start / end: {load} (timings follow the load)",
        "- diloco tcp / hivemind p2pd: k peer processes, each its own DHT peer (+ p2pd) joined to one bootstrap DHT, "
        "each a `SwarmAverager(transport=...)` over one float32 tensor, compression none, all released together; "
        "hivemind forms the group either way, then the bytes go over plain TCP sockets (tcp) or libp2p streams "
        "through p2pd (p2pd); **s** = the group's forming to the result (`RoundReport.allreduce_seconds`; "
        "matchmaking excluded, the round with matchmaking in the JSON as `round_s`), slowest peer, median over "
        f"{result['plan']['rounds']} rounds; MB/s per peer = payload bytes ÷ that time (MB = 10^6 bytes)",
        "- diloco groups: the trainer's path over tcp (since 2026-11-24): each peer a worker group of one rank whose "
        "`SwarmAverager(match_only=True)` only forms the group, the round (`group_round.GroupRounds`) then running "
        "over the TCP listener of the peer's own process, with the same tensor and timeouts",
        *(["- diloco groups p2pd: the same rounds over `--hv.transport p2pd` (since 2026-11-24): every connection a "
           "libp2p stream through both peers' p2pd daemons, whose Unix socket to its daemon each end's round reads "
           "and writes itself (`swarm.rounds.tunnel`; until 2026-11-28 bridged to a socket pair by an event loop)"]
          if "groups-p2pd" in result["arms"] else []),  # fmt: skip
        *(["- diloco groups keyed: the same rounds over tcp in a keyed swarm (`--hv.swarm-key`, since 2026-11-25): "
           "signed announcements, and every part and average sealed with AES-256-GCM (`swarm.rounds.frames`)"]
          if "groups-keyed" in result["arms"] else []),  # fmt: skip
        "- gloo: `torch.distributed.all_reduce` of the same tensor with k ranks, slowest rank, best call; socket / "
        "p2pd stream: the payload's bytes one way through one TCP connection / one libp2p stream between two p2pd "
        "daemons, best round",
        *[f"- {ARMS[t]}: not measured ({why})" for t, why in result["skipped"].items()],
        *(["- quick: payloads this small time start-up and latency, not the transports' rates; the verdicts below "
           "mean something for the full run only"] if result["quick"] else []),  # fmt: skip
        "",
        *loopback_table(result["loopback"]["rows"], arms),
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


def table_arms(arms: list[str]) -> list[str]:
    """The transports that get columns: tcp and p2pd ("–" when not measured: tcp before it existed), then any other
    measured; a run of some arms only (``--arms``) that left hivemind's p2pd out gets columns for its arms alone."""
    base = ["tcp", "p2pd"] if "p2pd" in arms else []
    return [*base, *(t for t in arms if t not in base)]


def loopback_table(rows: list[dict[str, Any]], arms: list[str]) -> list[str]:
    columns = table_arms(arms)
    lines = [
        "| parameters | payload MB | peers | "
        + "".join(f"{ARMS[t]} s | {ARMS[t]} MB/s per peer | " for t in columns)
        + "gloo s | gloo MB/s | p2pd stream MB/s | socket MB/s |",
        "|---:|---:|---:|" + "---:|---:|" * len(columns) + "---:|---:|---:|---:|",
    ]
    for row in rows:
        measured = [cell for t in columns for cell in cells(row, t, "median_s", "mb_s")]
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
        "CPU seconds per averaging round on loopback, all peers summed (median round), peak RSS of all peer "
        "processes (shared tensor buffers counted twice), and what a peer holds ÷ its payload: the peak PSS of all "
        "peer processes during one more, untimed round of the case (shared pages counted once; sampling it walks the "
        "page tables, which would slow the timed rounds) minus theirs before the case, per peer, ÷ the tensor's "
        "bytes (the tensor itself is 1 of it; the rest is the averager's copies and the round's buffers):",
        "",
        "| parameters | peers | transport | round s | averager CPU s | p2pd CPU s | DHT CPU s | caller CPU s | "
        "peak RSS MB | held ÷ payload |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for transport in arms:
            sw = row["arms"][transport]
            cpu = sw["cpu_s_median"]
            lines.append(
                f"| {row['size'] / 1e6:g}M | {row['peers']} | {ARMS[transport]} | {sw['median_s']:.2f} | "
                f"{cpu['averager']:.2f} | {cpu['p2pd']:.2f} | {cpu['dht']:.2f} | {cpu['caller']:.2f} | "
                f"{sw['tree_peak_rss_mb']:.0f} | {sw['held_per_payload']:.1f} |"
            )
    return lines


def kernel_mb(row: dict[str, Any], transport: str) -> str:
    """Median over peers and rounds of the bytes a peer's veth carried out during a round, MB."""
    swarm = row["arms"].get(transport)
    if swarm is None:
        return "–"
    return f"{statistics.median(v for per_round in swarm['kernel_sent'] for v in per_round) / 1e6:.0f}"


def shaped_table(sh: dict[str, Any], arms: list[str], target: float) -> list[str]:
    columns = table_arms(arms)
    lines = [
        f"Shaped link: each peer in its own network namespace, its veth shaped with `tc tbf` to {sh['rate_mbit']:g} "
        f"Mbit/s both ways; latency: {sh['latency']}. One TCP stream across it moves {sh['tcp_stream']['mb_s']:.0f} "
        f"MB/s, one p2pd stream {sh['p2pd_stream']['mb_s']:.0f} MB/s. Ideal = 2(k−1)/k × payload (what each peer "
        "must send, and receive, in a bandwidth-optimal all-reduce) ÷ link rate; ratio = measured ÷ ideal; kernel "
        "MB out = bytes the peer's veth carried out during the round (headers, framing and DHT traffic included), "
        "median over peers and rounds.",
        "",
        "| parameters | peers | required MB out | ideal s | " + "".join(f"{ARMS[t]} s | ratio | " for t in columns)
        + f"gloo s | gloo ratio | kernel MB out {' / '.join(columns)} |",
        "|---:|---:|---:|---:|" + "---:|---:|" * len(columns) + "---:|---:|---:|",
    ]
    for row in sh["rows"]:
        measured = [cell for t in columns for cell in cells(row, t, "median_s", "ratio")]
        lines.append(
            f"| {row['size'] / 1e6:g}M | {row['peers']} | {row['required_bytes'] / 1e6:.0f} | {row['ideal_s']:.2f} | "
            f"{' | '.join(measured)} | {row['gloo']['best_s']:.2f} | {row['gloo_ratio']:.2f} | "
            f"{' / '.join(kernel_mb(row, t) for t in columns)} |"
        )
    lines.append("")
    for transport in arms:
        worst = max(row["arms"][transport]["ratio"] for row in sh["rows"])
        verdict = "meets" if worst <= target else "misses"
        lines.append(f"Shaped: worst {ARMS[transport]} ratio {worst:.2f} ({verdict} the ≤ {target} target).")
    return lines

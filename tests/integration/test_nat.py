"""Groups behind home routers: real NAT (nftables masquerade, no inbound) in network namespaces, a public bridge with
the bootstrap peer and one group, and two homes behind routers of their own (both 192.168.1.0/24, as homes are)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.bench.netns import Host
from diloco.bench.routers import Topology, routed
from tests.integration.test_faults import trainers, wait_for
from tests.integration.test_galaxy import TEXT, assert_trained_together
from tests.support.groups import outer_rows
from tests.support.netns import assert_none_left, namespaces
from tests.support.paths import DILOCO, ROOT, TORCHRUN
from tests.support.procs import child_env, read_until, summary
from tests.support.swarm import kill_group, spawn

pytestmark = pytest.mark.xdist_group("netns")

HOME = {"GLOO_SOCKET_IFNAME": "lo"}  # a group's ranks share their host: torch.distributed over its loopback


RELAY_PORTS = "41000-41015"


@contextlib.contextmanager
def swarm_behind_routers(tmp_path: Path, homes: int = 2, *dht_flags: str) -> Iterator[tuple[Topology, list[str]]]:
    """The topology, and `diloco dht` running on its first public host (yields its --hv.initial-peers there)."""
    before = namespaces()
    with routed(public=2, homes=homes) as topology:
        used = {h.name for h in topology.public} | {x.name for home in topology.homes for x in (home.host, home.router)}
        bootstrap = topology.public[0]
        dht = spawn([*bootstrap.prefix(), str(DILOCO), "dht", "--identity", str(tmp_path / "id.pem"),
                     "--host-maddrs", "/ip4/0.0.0.0/tcp/0", *dht_flags])  # fmt: skip
        try:
            maddrs = read_until(dht, r"--hv\.initial-peers (.+)").group(1).split()
            yield topology, [m for m in maddrs if f"/ip4/{bootstrap.ip}/" in m]
        finally:
            dht.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                dht.wait(timeout=20)
            kill_group(dht)
    assert_none_left(before, used)


def start(host: Host, tmp_path: Path, name: str, peers: list[str], world_rank: int, galaxy: int, ranks: int,
          steps: int, *own: str) -> tuple[subprocess.Popen[str], Path]:  # fmt: skip
    """A worker group of `ranks` ranks on `host`, output to ``<name>.log``; returns it and its run folder."""
    run_dir = tmp_path / name
    args = [*TEXT, "--total-batch-size", "8", "--max-steps", str(steps), "--hv.local-steps", "4",
            "--hv.galaxy-size", str(galaxy), "--hv.world-rank", str(world_rank), "--hv.initial-peers", *peers,
            *own, "--run-dir", str(run_dir)]  # fmt: skip
    launch = [str(TORCHRUN), "--standalone", f"--nproc_per_node={ranks}", "-m", "diloco.train"]
    with (tmp_path / f"{name}.log").open("a") as log:
        proc = subprocess.Popen([*host.prefix(), *launch, *args], cwd=ROOT, env=child_env() | HOME, stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    return proc, run_dir


def said(run_dir: Path) -> str:
    return run_dir.with_suffix(".log").read_text()


def finish(started: list[tuple[subprocess.Popen[str], Path]], timeout: float = 300) -> list[str]:
    """Wait for every group to end with exit code 0; their logs."""
    deadline = time.monotonic() + timeout
    try:
        for proc, run_dir in started:
            code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
            assert code == 0, said(run_dir)[-3000:]
    finally:
        for proc, _ in started:
            kill_group(proc)
    return [said(run_dir) for _, run_dir in started]


@pytest.mark.slow
@pytest.mark.parametrize("relay", [False, True], ids=["no-relay", "relay"])
def test_groups_behind_two_routers_and_a_public_group_average_bit_identically(tmp_path: Path, relay: bool) -> None:
    """A public 1-rank group, a 1-rank group behind one router and a 2-rank FULL_SHARD group behind the other: each
    rank learns at join whether it can be dialled (the public one: direct; the homes' ranks: outbound only, or
    relayed when the bootstrap peer offers a relay), the homes' ranks reduce nothing and are never dialled (a
    direct reducer is cheaper than one behind a relay), and all three groups stay bit-identical after every round."""
    flags = ["--relay-ports", RELAY_PORTS] if relay else []
    with swarm_behind_routers(tmp_path, 2, *flags) as (topology, peers):
        hosts = [topology.public[1], topology.homes[0].host, topology.homes[1].host]
        started = [start(host, tmp_path, f"g{i}", peers, i, 3, ranks, 12)
                   for i, (host, ranks) in enumerate(zip(hosts, (1, 1, 2)))]  # fmt: skip
        outputs = finish(started)
    run_dirs = [run_dir for _, run_dir in started]
    assert_trained_together(run_dirs, groups=3, outer_steps=3)
    direct = r"rank 0 can be dialled: direct \(peer \w+ dialled it back at 10\."
    assert re.search(direct, outputs[0]), outputs[0][-3000:]
    for output, ranks in zip(outputs[1:], (1, 2)):
        if relay:
            assert re.findall(r"rank (\d) can be dialled through a relay: relayed", output) == ["0"], output[-3000:]
            continue
        said = re.findall(r"rank (\d) cannot be dialled \(peer \w+ could not dial 192\.168\.1\.2", output)
        assert sorted(said) == [str(r) for r in range(ranks)], output[-3000:]
    # the homes sent their shards and received the averages over the connections they opened, every round
    # (nobody could have dialled them: a round that needed it would have failed), and reduced for nobody
    for run_dir in run_dirs[1:]:
        full = [r for r in outer_rows(run_dir) if r.get("num_peers") == 3]
        assert full and all(r["bytes_sent"] > 0 and r["bytes_received"] > 0 for r in full), full
        assert all(r["bytes_inbound"] == 0 for r in full), full
    public = [r for r in outer_rows(run_dirs[0]) if r.get("num_peers") == 3]  # it reduced every span
    assert public and all(r["bytes_inbound"] == r["bytes_sent"] + r["bytes_received"] for r in public), public
    assert all(r["bytes_relayed"] == 0 for d in run_dirs for r in outer_rows(d) if "bytes_relayed" in r)


@pytest.mark.slow
def test_a_late_joiner_behind_a_router_loads_the_state_from_the_group_that_can_be_dialled(tmp_path: Path) -> None:
    """A public group and a group behind one router train; a 2-rank FULL_SHARD group behind the other router joins
    late. The home group serves no state (nobody could dial it), so each of the joiner's ranks downloads its rows from
    the public group, over connections it opens; then all three average bit-identically."""
    with swarm_behind_routers(tmp_path) as (topology, peers):
        early = [start(host, tmp_path, f"g{i}", peers, i, 3, 1, 40)
                 for i, host in enumerate([topology.public[1], topology.homes[0].host])]  # fmt: skip
        started = list(early)
        try:
            wait_for(lambda: len(outer_rows(early[0][1])) >= 2, 180, "two outer steps of the first groups",
                     [proc for proc, _ in early])  # fmt: skip
            # the first groups' training processes pause (their DHT peers and listeners go on serving) while the
            # joiner starts up, as in test_faults' late joiner: under load its start-up outlasts their run
            paused = [pid for proc, _ in early for pid in trainers(proc, True)]
            for pid in paused:
                os.kill(pid, signal.SIGSTOP)
            started.append(start(topology.homes[1].host, tmp_path, "g2", peers, 2, 3, 2, 40, "--seed", "7"))
            try:
                wait_for(lambda: "worker group 2 starting" in said(started[2][1]), 180, "the joiner",
                         [started[2][0]])  # fmt: skip
            finally:
                for pid in paused:
                    os.kill(pid, signal.SIGCONT)
            outputs = finish(started)
        finally:
            for proc, _ in started:
                kill_group(proc)
    run_dirs = [run_dir for _, run_dir in started]
    joined = summary(run_dirs[2])
    assert joined["status"] == "ok" and joined["loaded_state_from_peers"] is True, (joined, outputs[2][-3000:])
    sources = set(re.findall(r"loaded the outer state of worker group (\d+)", outputs[2]))
    assert sources == {"0"}, outputs[2][-3000:]  # never the home group, which serves no state
    finals = [summary(d) for d in run_dirs]
    assert all(f["status"] == "ok" for f in finals) and len({f["params_sha256"] for f in finals}) == 1, finals


@pytest.mark.slow
def test_an_undialable_announced_address_is_named_and_a_swarm_nobody_can_dial_says_so_once(tmp_path: Path) -> None:
    """Bad input, one swarm: a group on the public bridge announces an address of that bridge nobody holds (the
    dial-back finds it at join: one warning names --hv.announce-maddrs, and the rank dials out only), beside two
    groups behind routers. No group can be dialled, so no matchmaking can form (none may lead one): each group says
    once why its rounds find nobody, trains alone and ends cleanly, instead of timing out round after round."""
    with swarm_behind_routers(tmp_path) as (topology, peers):
        nobody = topology.public[1].ip.rsplit(".", 1)[0] + ".99"
        hosts = [topology.public[1], *(home.host for home in topology.homes)]
        announce = [["--hv.announce-maddrs", f"/ip4/{nobody}/tcp/41000"], [], []]
        started = [start(host, tmp_path, f"g{i}", peers, i, 3, 1, 8, *own)
                   for i, (host, own) in enumerate(zip(hosts, announce))]  # fmt: skip
        outputs = finish(started)
    warned = [line for line in outputs[0].splitlines() if "--hv.announce-maddrs" in line]
    assert len(warned) == 1 and f"could not dial {nobody}" in warned[0], outputs[0][-3000:]
    assert "dials out only" in warned[0]
    for output, (_, run_dir) in zip(outputs, started):
        assert output.count("found no group in the swarm that can") == 1, output[-3000:]
        assert "Traceback" not in output
        assert [r.get("num_peers") for r in outer_rows(run_dir)] == [1, 1], outer_rows(run_dir)


@pytest.mark.slow
def test_groups_behind_two_routers_average_through_a_relay(tmp_path: Path) -> None:
    """No group can be dialled: a 1-rank group behind one router and a 2-rank FULL_SHARD group behind the other,
    and `diloco dht --relay-ports` on the public bridge. Each rank learns it cannot be dialled, leases ports at the
    relay and is dialled back there (relayed); rank 0's DHT peer is dialled there too, so the groups' matchmaking
    forms, and every round has both groups, bit-identical after each."""
    with swarm_behind_routers(tmp_path, 2, "--relay-ports", RELAY_PORTS) as (topology, peers):
        hosts = [home.host for home in topology.homes]
        started = [start(host, tmp_path, f"g{i}", peers, i, 2, ranks, 12)
                   for i, (host, ranks) in enumerate(zip(hosts, (1, 2)))]  # fmt: skip
        outputs = finish(started)
    run_dirs = [run_dir for _, run_dir in started]
    assert_trained_together(run_dirs, groups=2, outer_steps=3)
    relayed = rf"rank (\d) can be dialled through a relay: relayed \(at {re.escape(topology.public[0].ip)} port 410"
    for output in outputs:
        assert re.findall(relayed, output) == ["0"], output[-3000:]  # rank 0 says it; the others at debug level
    for run_dir in run_dirs:  # each reduced for the other, dialled at the relay: every byte crossed it
        full = [r for r in outer_rows(run_dir) if r.get("num_peers") == 2]
        assert full and all(r["bytes_inbound"] > 0 for r in full), full
        assert all(r["bytes_relayed"] == r["bytes_sent"] + r["bytes_received"] for r in full), full


def relay_dht(host: Host, tmp_path: Path, port: int) -> subprocess.Popen[str]:
    """`diloco dht --relay-ports` on `host`, its DHT at a fixed `port` (a restart keeps its multiaddrs)."""
    return spawn([*host.prefix(), str(DILOCO), "dht", "--identity", str(tmp_path / "id.pem"), "--host-maddrs",
                  f"/ip4/0.0.0.0/tcp/{port}", "--relay-ports", RELAY_PORTS])  # fmt: skip


def stop(proc: subprocess.Popen[str]) -> None:
    kill_group(proc)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=20)


@pytest.mark.slow
def test_a_relay_killed_mid_run_fails_the_rounds_cleanly_and_they_recover_when_it_returns(tmp_path: Path) -> None:
    """The two homes of the relay test train on; the relay (with the bootstrap peer: one `diloco dht`) is killed
    with SIGKILL after two rounds and started again 10 s later with the same identity and ports. Each rank says once
    that its relay is gone and once that it is back, with the ports it had; the rounds meanwhile find nobody or
    fail, with no traceback, and once it is back the groups average together again and end on one model."""
    before = namespaces()
    with routed(public=1, homes=2) as topology:
        used = {topology.public[0].name} | {x.name for home in topology.homes for x in (home.host, home.router)}
        public = topology.public[0]
        dht = relay_dht(public, tmp_path, 40999)
        started: list[tuple[subprocess.Popen[str], Path]] = []
        try:
            maddrs = read_until(dht, r"--hv\.initial-peers (.+)").group(1).split()
            peers = [m for m in maddrs if f"/ip4/{public.ip}/" in m]
            started = [start(home.host, tmp_path, f"g{i}", peers, i, 2, ranks, 120)
                       for i, (home, ranks) in enumerate(zip(topology.homes, (1, 2)))]  # fmt: skip
            procs = [proc for proc, _ in started]
            wait_for(lambda: all(sum(r.get("num_peers") == 2 for r in outer_rows(d)) >= 2 for _, d in started), 240,
                     "two rounds of both groups", procs)  # fmt: skip
            stop(dht)
            wait_for(lambda: all("is gone" in said(d) for _, d in started), 60, "the ranks to see the relay go", procs)
            time.sleep(10)
            dht = relay_dht(public, tmp_path, 40999)
            read_until(dht, r"--hv\.initial-peers")
            wait_for(lambda: all("is back" in said(d) for _, d in started), 60, "the ranks to see it back", procs)
            outputs = finish(started, timeout=600)
        finally:
            for proc, _ in started:
                kill_group(proc)
            stop(dht)
    assert_none_left(before, used)
    run_dirs = [run_dir for _, run_dir in started]
    for output, ranks in zip(outputs, (1, 2)):
        assert "Traceback" not in output, output[-3000:]
        assert output.count("is gone") == ranks and output.count("is back") == ranks, output[-3000:]
    rows = [outer_rows(d) for d in run_dirs]
    finals = [summary(d) for d in run_dirs]
    assert all(f["status"] == "ok" for f in finals) and len({f["params_sha256"] for f in finals}) == 1, finals
    # together again after the relay returned: the last rounds have both groups, bit-identical
    last = [{r["outer_step"]: r for r in per_group[-3:] if r.get("num_peers") == 2} for per_group in rows]
    shared = set(last[0]) & set(last[1])
    assert shared and all(last[0][s]["params_sha256"] == last[1][s]["params_sha256"] for s in shared), rows

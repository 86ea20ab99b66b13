"""Groups behind home routers: real NAT (nftables masquerade, no inbound) in network namespaces, a public bridge with
the bootstrap peer and one group, and two homes behind routers of their own (both 192.168.1.0/24, as homes are)."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.bench.nat import Topology, routed
from diloco.bench.netns import Host
from tests.integration.test_galaxy import TEXT, assert_trained_together
from tests.support.groups import outer_rows
from tests.support.netns import assert_none_left, namespaces
from tests.support.paths import DILOCO, TORCHRUN
from tests.support.procs import read_until
from tests.support.swarm import kill_group, spawn

pytestmark = pytest.mark.xdist_group("netns")

HOME = {"GLOO_SOCKET_IFNAME": "lo"}  # a group's ranks share their host: torch.distributed over its loopback


@contextlib.contextmanager
def swarm_behind_routers(tmp_path: Path, homes: int = 2) -> Iterator[tuple[Topology, list[str]]]:
    """The topology, and `diloco dht` running on its first public host (yields its --hv.initial-peers there)."""
    before = namespaces()
    with routed(public=2, homes=homes) as topology:
        used = {h.name for h in topology.public} | {x.name for home in topology.homes for x in (home.host, home.router)}
        bootstrap = topology.public[0]
        dht = spawn([*bootstrap.prefix(), str(DILOCO), "dht", "--identity", str(tmp_path / "id.pem"),
                     "--host-maddrs", "/ip4/0.0.0.0/tcp/0"])  # fmt: skip
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
    run_dir = tmp_path / name
    args = [*TEXT, "--total-batch-size", "8", "--max-steps", str(steps), "--hv.local-steps", "4",
            "--hv.galaxy-size", str(galaxy), "--hv.world-rank", str(world_rank), "--hv.initial-peers", *peers,
            *own, "--run-dir", str(run_dir)]  # fmt: skip
    launch = [str(TORCHRUN), "--standalone", f"--nproc_per_node={ranks}", "-m", "diloco.train"]
    return spawn([*host.prefix(), *launch, *args], HOME), run_dir


def finish(procs: list[subprocess.Popen[str]], timeout: float = 300) -> list[str]:
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    return outputs


@pytest.mark.slow
def test_groups_behind_two_routers_and_a_public_group_average_bit_identically(tmp_path: Path) -> None:
    """A public 1-rank group, a 1-rank group behind one router and a 2-rank FULL_SHARD group behind the other: each
    rank learns at join whether it can be dialled (the public one: direct; the homes' ranks: outbound only), the
    homes' ranks reduce nothing and are never dialled, and all three groups stay bit-identical after every round."""
    with swarm_behind_routers(tmp_path) as (topology, peers):
        hosts = [topology.public[1], topology.homes[0].host, topology.homes[1].host]
        started = [start(host, tmp_path, f"g{i}", peers, i, 3, ranks, 12)
                   for i, (host, ranks) in enumerate(zip(hosts, (1, 1, 2)))]  # fmt: skip
        outputs = finish([proc for proc, _ in started])
    run_dirs = [run_dir for _, run_dir in started]
    assert_trained_together(run_dirs, groups=3, outer_steps=3)
    direct = r"rank 0 can be dialled: direct \(peer \w+ dialled it back at 10\."
    assert re.search(direct, outputs[0]), outputs[0][-3000:]
    for output, ranks in zip(outputs[1:], (1, 2)):
        said = re.findall(r"rank (\d) cannot be dialled \(peer \w+ could not dial 192\.168\.1\.2", output)
        assert sorted(said) == [str(r) for r in range(ranks)], output[-3000:]
    # the homes sent their shards and received the averages over the connections they opened, every round
    for run_dir in run_dirs[1:]:
        full = [r for r in outer_rows(run_dir) if r.get("num_peers") == 3]
        assert full and all(r["bytes_sent"] > 0 and r["bytes_received"] > 0 for r in full), full

"""Hosts of their own for benchmarks: one network namespace per peer, each joined to a bridge in the root
namespace by a veth pair, optionally shaped with `tc tbf`. Needs root (`ip netns`, `ip link`, `tc`).

Addresses are 10.<net>.0.<i+1>/24 inside the namespaces and 10.<net>.0.254 on the bridge, so a process in the
root namespace (a DHT peer) reaches all of them. The kernel counts every byte that crosses a veth: read
`Host.counters()` before and after a run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil

from diloco import procs
from diloco.bench import BenchError, shielded


@dataclass(frozen=True)
class Host:
    """One namespace: `name`, its address `ip`, the host-side end of its veth (`veth`) and the namespace's end of
    it (`iface`, what GLOO_SOCKET_IFNAME names)."""

    name: str
    ip: str
    veth: str
    iface: str

    def prefix(self) -> list[str]:
        """Prepend to a command to run it inside this namespace."""
        return ["ip", "netns", "exec", self.name]

    def counters(self) -> tuple[int, int]:
        """(bytes sent, bytes received) by this namespace, as the kernel counts them on its veth (IP headers and
        all): what the namespace sends is what its peer end receives."""
        base = f"/sys/class/net/{self.veth}/statistics"
        with open(f"{base}/rx_bytes") as rx, open(f"{base}/tx_bytes") as tx:
            return int(rx.read()), int(tx.read())


def available() -> str | None:
    """None when namespaces can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"needs {', '.join(missing)}" if missing else None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise BenchError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _shape(device: str, rate_mbit: float, netns: str | None = None) -> None:
    """tbf on `device`'s egress: `rate_mbit` with a burst of 1 ms worth of bytes (at least 64 KiB) and 50 ms
    of queue. netem (delay) is not available on this kernel, so links have bandwidth but no added latency."""
    burst = max(int(rate_mbit * 1e6 / 8 / 1000), 65536)
    cmd = ["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{rate_mbit}mbit",
           "burst", str(burst), "latency", "50ms"]  # fmt: skip
    result = subprocess.run((["ip", "netns", "exec", netns] if netns else []) + cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise BenchError(f"{' '.join(cmd)}: {result.stderr.strip()}")


def free_net() -> int:
    """A second octet N for namespaces at 10.N.0.0/24 that no interface here uses yet (another bench or test
    suite may run beside this one)."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for net in [*range(100 + os.getpid() % 100, 250), *range(100, 100 + os.getpid() % 100)]:
        if f" 10.{net}." not in used:
            return net
    raise BenchError("no free 10.N.0.0/24 network for the namespaces")


@contextmanager
def hosts(count: int, rate_mbit: float | None = None, net: int | None = None) -> Iterator[list[Host]]:
    """`count` namespaces on one bridge; with `rate_mbit`, each veth is shaped to it in both directions (so
    each host has a link of that bandwidth to the bridge). Everything is deleted on exit."""
    why = available()
    if why:
        raise BenchError(f"network namespaces: {why}")
    tag = f"dl{os.getpid() % 100000}"
    net = net if net is not None else free_net()
    bridge = f"{tag}br"
    made: list[Host] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"10.{net}.0.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i in range(count):
            host = Host(name=f"{tag}n{i}", ip=f"10.{net}.0.{i + 1}", veth=f"{tag}h{i}", iface=f"{tag}p{i}")
            with shielded():  # a stop signal between the two would leave it behind
                _ip("netns", "add", host.name)
                made.append(host)
            inner = host.iface
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", inner, "netns", host.name)
            _ip("link", "set", host.veth, "master", bridge, "up")
            _ip("-n", host.name, "addr", "add", f"{host.ip}/24", "dev", inner)
            _ip("-n", host.name, "link", "set", inner, "up")
            _ip("-n", host.name, "link", "set", "lo", "up")
            if rate_mbit:
                _shape(host.veth, rate_mbit)  # towards the namespace
                _shape(inner, rate_mbit, host.name)  # out of the namespace
        yield made
    finally:
        with shielded():  # a stop signal now would leave namespaces behind: it waits until they are gone
            for host in made:
                kill_inside(host.name)
                # the pair goes now (a namespace's own links only go when the kernel gets round to freeing it)
                subprocess.run(["ip", "link", "delete", host.veth], capture_output=True)
                subprocess.run(["ip", "netns", "delete", host.name], capture_output=True)
            subprocess.run(["ip", "link", "delete", bridge], capture_output=True)


def kill_inside(name: str) -> None:
    """SIGKILL every process still inside namespace `name` and wait until they are gone. Its users stop their own
    processes first (gracefully); this catches what a stop cut short. `ip netns delete` only unnames a namespace:
    a process left inside would keep it, and run on, unseen. The namespace is this bench's (its name carries the
    bench's pid), so whatever runs inside it was started by this bench."""
    listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    found = []
    for pid in listed.split():
        with contextlib.suppress(ValueError, psutil.NoSuchProcess):
            found.append(psutil.Process(int(pid)))
    procs.kill_all(found)

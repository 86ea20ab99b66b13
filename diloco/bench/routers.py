"""Home routers for benchmarks and tests: hosts on a "public" bridge, and homes that reach it only through a router
of their own doing NAT, as a home or office network does. Needs root (`ip netns`, `ip link`, `nft`, `tc`).

The public network is 10.<net>.0.0/24: its hosts are 10.<net>.0.1, 10.<net>.0.2, ..., the routers' outside ends the
addresses after them, and the bridge itself (in the root namespace) 10.<net>.0.254. Every home is 192.168.1.0/24,
as most home networks are: its host is 192.168.1.2 behind its router's 192.168.1.1. A router masquerades what
leaves through its outside end and forwards nothing that comes in unasked (``ct state established,related``): a
home host can dial any public host, and no public host (nor the other home) can dial a home host. A home's default
route is its router, and routers have none: traffic stays between the namespaces made here.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from diloco.bench import BenchError, shielded
from diloco.bench.netns import Host, _ip, _shape, available, free_net, hosts, kill_inside

HOME_IP = "192.168.1.2"
ROUTER_LAN_IP = "192.168.1.1"


@dataclass(frozen=True)
class Home:
    """A home: its `host` (where trainers run) and its `router` (a namespace with the outside end `router.ip`)."""

    host: Host
    router: Host


@dataclass(frozen=True)
class Topology:
    public: list[Host]
    homes: list[Home]


def nat_available() -> str | None:
    """None when routers can be made here, else why not (one line)."""
    return available() or (None if shutil.which("nft") else "needs nft (Debian's nftables package)")


def _nft(netns: str, ruleset: str) -> None:
    result = subprocess.run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=ruleset, capture_output=True,
                            text=True)  # fmt: skip
    if result.returncode != 0:
        raise BenchError(f"nft in {netns}: {result.stderr.strip()}")


def _router_rules(wan: str, lan: str) -> str:
    return f"""
table ip nat {{
    chain postrouting {{ type nat hook postrouting priority 100; oifname "{wan}" masquerade; }}
}}
table inet filter {{
    chain forward {{
        type filter hook forward priority 0; policy drop;
        ct state established,related accept
        iifname "{lan}" oifname "{wan}" accept
    }}
}}
"""


@contextmanager
def routed(public: int, homes: int, uplink_mbit: float | None = None, net: int | None = None) -> Iterator[Topology]:
    """`public` hosts on one bridge and `homes` homes behind routers on it; with `uplink_mbit`, each router's
    outside link is shaped to it both ways (the home's uplink). Everything is deleted on exit."""
    why = nat_available()
    if why:
        raise BenchError(f"home routers: {why}")
    net = net if net is not None else free_net()
    made: list[Host] = []
    with hosts(public + homes, net=net) as outside:
        routers = outside[public:]
        try:
            for router in routers:
                home = Host(name=f"{router.name}h", ip=HOME_IP, veth=f"{router.veth}l", iface=f"{router.iface}l")
                with shielded():
                    _ip("netns", "add", home.name)
                    made.append(home)
                # the router's inside end (`veth`, in the router) and the home host's end (`iface`)
                _ip("link", "add", home.veth, "netns", router.name, "type", "veth", "peer", "name", home.iface,
                    "netns", home.name)  # fmt: skip
                _ip("-n", router.name, "addr", "add", f"{ROUTER_LAN_IP}/24", "dev", home.veth)
                _ip("-n", router.name, "link", "set", home.veth, "up")
                _ip("-n", home.name, "addr", "add", f"{HOME_IP}/24", "dev", home.iface)
                _ip("-n", home.name, "link", "set", home.iface, "up")
                _ip("-n", home.name, "link", "set", "lo", "up")
                _ip("-n", home.name, "route", "add", "default", "via", ROUTER_LAN_IP)
                subprocess.run(["ip", "netns", "exec", router.name, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                               check=True, capture_output=True)  # fmt: skip
                _nft(router.name, _router_rules(router.iface, home.veth))
                if uplink_mbit:
                    _shape(router.iface, uplink_mbit, router.name)  # out of the home
                    _shape(router.veth, uplink_mbit)  # into it
            yield Topology(outside[:public], [Home(home, router) for home, router in zip(made, routers)])
        finally:
            with shielded():
                for home in made:
                    kill_inside(home.name)
                    subprocess.run(["ip", "netns", "delete", home.name], capture_output=True)

"""Addresses: from the multiaddrs a user gives (``/ip4/0.0.0.0/tcp/31337``) to where each rank listens and what it
tells its groupmates. multiaddr only; no hivemind.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from multiaddr import Multiaddr


def ips(maddr: Multiaddr | str) -> list[str]:
    """The ip4 and ip6 parts of a multiaddr, in that order."""
    maddr = Multiaddr(maddr) if isinstance(maddr, str) else maddr
    found = []
    for protocol in ("ip4", "ip6"):
        try:
            found.append(maddr.value_for_protocol(protocol))
        except Exception:  # the multiaddr has no such part (the package raises its own error types)
            continue
    return found


def without_p2p(maddr: str) -> str:
    """The transport part of a multiaddr, without its ``/p2p/<peer id>`` (p2pd's connect takes the peer id apart)."""
    return maddr.split("/p2p/")[0]


def offset_port(maddr: str, offset: int) -> str:
    """`maddr` with its TCP port moved up by `offset`: each local rank gets its own port when the user named a
    fixed one (port 0 stays 'any free port'; a multiaddr without a TCP part is left alone)."""
    try:
        port = int(Multiaddr(maddr).value_for_protocol("tcp"))
    except Exception:  # no tcp part: nothing to shift
        return maddr
    return maddr if port == 0 or offset == 0 else maddr.replace(f"/tcp/{port}", f"/tcp/{port + offset}", 1)


def listen_host(host_maddrs: Sequence[str]) -> str:
    """Where the TCP transport listens: the IP of the first of ``host_maddrs`` that names one, else everywhere."""
    for maddr in host_maddrs:
        if found := ips(maddr):
            return found[0]
    return "0.0.0.0"


def announced_hosts(visible: Iterable[Multiaddr | str]) -> list[str]:
    """The IP addresses in the multiaddrs a DHT peer announces (``dht.get_visible_maddrs()``), in order, loopback
    last; ``["127.0.0.1"]`` when it announces none."""
    hosts: list[str] = []
    for maddr in visible:
        for host in ips(maddr):
            if host not in hosts and host not in ("0.0.0.0", "::"):
                hosts.append(host)
    # loopback last: on another machine it reaches that machine (the handshake then fails and the next is tried)
    return sorted(hosts, key=lambda host: host.startswith("127.") or host == "::1") or ["127.0.0.1"]

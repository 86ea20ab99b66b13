"""DHT peers in the test's own process, on loopback: starting one, and shutting it down with its p2pd daemons."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    import hivemind

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def p2pd_pids(root_pid: int) -> list[int]:
    """p2pd daemons among the descendants of ``root_pid`` (a DHT process or a process that runs DHTs)."""
    pids = []
    for proc in psutil.Process(root_pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.name() == "p2pd":
                pids.append(proc.pid)
    return pids


def leftover(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Wait for ``pids`` to exit; kill (by pid) and return those still running after ``timeout`` seconds."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    survivors = []
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
                survivors.append(proc.pid)
    return survivors


def shutdown_dht(dht: hivemind.DHT) -> list[int]:
    """Shut ``dht`` down; return the pids of its p2pd daemons that did not exit (and were then killed)."""
    pids = p2pd_pids(dht.pid) if dht.is_alive() else []
    dht.shutdown()
    return leftover(pids)


@contextlib.contextmanager
def bootstrap_dht() -> Iterator[hivemind.DHT]:
    """A DHT peer on 127.0.0.1 that starts a new swarm; shut down at the end, none of its p2pd daemons left."""
    from diloco.swarm.records.dht import start_dht

    dht = start_dht(initial_peers=[], host_maddrs=LOCAL, announce_maddrs=[])
    try:
        yield dht
    finally:
        assert shutdown_dht(dht) == []

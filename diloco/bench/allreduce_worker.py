"""The worker process of `diloco bench allreduce` (``python -m diloco.bench.allreduce_worker``): the roles that run
in child processes, one per peer, started by ``diloco.bench.allreduce.Child``.

A worker imports torch and hivemind once (3-6 s each on 2 cores: most of a quick run when every arm started
processes of its own), then runs the roles it is sent, one JSON line ``[role, *args]`` on stdin each, one after
another (a stream end, a gloo rank, a swarm peer), answers in ``TAG {json}`` lines on stdout, and exits when its
stdin closes or the bench is gone. torch and hivemind are imported in the running worker only: the bench imports
the constants below without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from diloco import procs

if TYPE_CHECKING:  # the worker imports them once it runs (hivemind and torch take seconds to import)
    import torch

    from diloco.swarm.rounds.group_round import GroupRounds
    from diloco.swarm.rounds.report import RoundReport

MATCHMAKING_S = 20.0  # peers start together and the group forms as soon as all k joined: rarely waited out
AVERAGING_TIMEOUT_S = 120.0  # one all-reduce may take this long; a silent groupmate is dropped after a quarter
CHUNK = 2**22  # bytes per write of the socket and p2pd streams


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
    one tensor (transport "groups" and "groups-p2pd": the trainer's rounds of whole groups, ``group_round.GroupRounds``,
    for a group of one rank, over tcp and p2pd), READY, then per ``go`` on stdin one round and RESULT, until ``next``.

    RESULT holds the round's report, ``round_s`` (seconds around the ``average`` call), ``allreduce_s`` (the
    report's ``allreduce_seconds``: from the group's forming to the result, matchmaking excluded) and a checksum that
    bit-identical results share.
    """
    import torch

    from diloco.bench.averager import SwarmAverager
    from diloco.swarm.records.dht import start_dht

    dht = start_dht(initial_peers=initial_peers, host_maddrs=[f"/ip4/{ip}/tcp/0"], announce_maddrs=[])
    try:
        for size, transport in cases:
            # the memory of this peer's processes before the case (the last case's averager is gone): the baseline
            # of what the case holds
            pss_before_mb = procs.tree_pss_mb(os.getpid())
            tensor = torch.randn(size, generator=torch.Generator().manual_seed(index))
            if transport.startswith("groups"):
                over = "p2pd" if transport == "groups-p2pd" else "tcp"
                keyed = transport == "groups-keyed"
                with whole_group(dht, f"{prefix}-{transport}-{size}", ip, size, k, over, keyed) as rounds:
                    emit("READY", {"size": size, "transport": transport, "pss_before_mb": pss_before_mb})
                    average_rounds(lambda i: rounds.average([tensor], i, 1.0, lambda: False), tensor)
                continue
            # a group with any p2pd member averages over libp2p: each transport gets a key of its own
            with SwarmAverager(
                dht, prefix=f"{prefix}-{transport}-{size}", tensors=[tensor], compression="none",
                matchmaking_time=MATCHMAKING_S, averaging_timeout=AVERAGING_TIMEOUT_S, target_group_size=k,
                transport=transport,
            ) as averager:  # fmt: skip
                emit("READY", {"size": size, "transport": transport, "pss_before_mb": pss_before_mb})
                average_rounds(lambda i: averager.average([tensor], round_index=i), tensor)
    finally:
        dht.shutdown()


@contextlib.contextmanager
def whole_group(dht: object, prefix: str, ip: str, size: int, k: int, transport: str, keyed: bool = False
                ) -> Iterator[GroupRounds]:  # fmt: skip
    """The rounds of a 1-rank worker group as ``diloco.swarm.start`` sets them up: a ``Matchmaker`` finds the
    round's groups, a listener in this process carries the round (its timeouts the trainer's), reached over TCP or,
    with `transport` "p2pd", over libp2p streams through this peer's daemon (``tunnel``). `keyed`: in a keyed
    swarm, every peer's key made from `prefix` (a bench's key, no secret)."""

    from diloco.swarm.records.swarm_key import SwarmKey
    from diloco.swarm.rounds import tcp
    from diloco.swarm.rounds.codecs import WIRE_FORMATS
    from diloco.swarm.rounds.group_round import GroupRounds
    from diloco.swarm.rounds.layout import Shape
    from diloco.swarm.rounds.listener import Listener, listen_socket
    from diloco.swarm.rounds.matchmaker import Matchmaker
    from diloco.swarm.rounds.tunnel import Tunnel
    from diloco.swarm.start import IDLE_WAIT_S

    matcher = Matchmaker(dht, prefix=prefix, matchmaking_time=MATCHMAKING_S, averaging_timeout=AVERAGING_TIMEOUT_S,
                         target_group_size=k)
    listening = listen_socket(ip, 0) if transport == "tcp" else None
    listener = Listener(listening, AVERAGING_TIMEOUT_S / 4, registration_timeout=AVERAGING_TIMEOUT_S,
                        idle_wait=IDLE_WAIT_S).start()  # fmt: skip
    tunnel = None
    try:
        if listening is not None:
            endpoint, connect = ([ip], listening.getsockname()[1]), tcp.connect
        else:
            tunnel = Tunnel(dht, listener)
            endpoint, connect = ((tunnel.peer_id,), 0), tunnel.connect
        yield GroupRounds(
            matcher, rank=0, shape=Shape("FULL_SHARD", 1), model_shapes=[(size,)], endpoints=[endpoint],
            broadcast=lambda found: found, listener=listener, codec=WIRE_FORMATS["none"].tcp,
            timeout=AVERAGING_TIMEOUT_S / 4, replicas=None, connect=connect, tunnel=tunnel,
            key=SwarmKey(hashlib.sha256(prefix.encode()).digest()) if keyed else None,
            p2p=[tunnel.peer_id] if tunnel is not None else None,
        )  # fmt: skip
    finally:
        if tunnel is not None:
            tunnel.close()
        listener.close()
        matcher.shutdown()


def average_rounds(average: Callable[[int], RoundReport], tensor: torch.Tensor) -> None:
    """Per ``go`` on stdin one averaging round of ``tensor`` (``average(round_index)``) and its RESULT, until
    ``next``."""
    for round_index in itertools.count():
        command = sys.stdin.readline().strip()
        if command == "next":
            return
        if command != "go":
            raise SystemExit(1)  # the bench is gone or out of step
        started = time.monotonic()
        report = average(round_index)
        round_s = time.monotonic() - started
        emit("RESULT", asdict(report) | {"round_s": round_s, "allreduce_s": report.allreduce_seconds,
                                         "checksum": float(tensor.sum())})  # fmt: skip


ROLES = {
    "socket-receiver": socket_receiver,
    "socket-sender": socket_sender,
    "p2pd-receiver": lambda *args: asyncio.run(p2pd_receiver(*args)),
    "p2pd-sender": lambda *args: asyncio.run(p2pd_sender(*args)),
    "gloo": gloo_rank,
    "peer": swarm_peer,
}


def worker() -> None:
    """``python -m diloco.bench.allreduce_worker``: import what every role needs, say STARTED, then run the roles
    read from stdin (``[role, *args]`` as JSON) one after another, each followed by IDLE, until stdin closes (exit
    code 0). A role that fails ends the worker with its traceback in the log and exit code 1."""
    # a bench killed mid-round must not leave peers behind (their DHT, averager and p2pd follow them)
    procs.exit_with_parent()
    import hivemind.p2p  # noqa: F401  (hivemind imports torch)
    import torch
    import torch.distributed  # noqa: F401

    import diloco.swarm.rounds.matchmaker  # noqa: F401

    torch.set_num_threads(1)
    emit("STARTED", {})
    while line := sys.stdin.readline():
        role, *args = json.loads(line)
        ROLES[role](*args)
        emit("IDLE", {})
    os._exit(0)  # every role has stopped what it started; the interpreter's teardown would take seconds


if __name__ == "__main__":
    worker()

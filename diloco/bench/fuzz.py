"""The fuzz bench: malformed, truncated, oversized, wrong-typed and deeply nested inputs thrown at every parser of
what peers send (DHT records, matchmaking announcements, sealed values, state metadata, the wire formats, framed
messages) and at a live listener, counting per target its inputs, refusals, crashes and hangs.

Inputs come from a seeded mutator started from valid examples, built the way the trainer builds them, so most of
them get past the first check. A refusal (None, False, or the ValueError a parser's contract names) is the expected
outcome; a crash is any other exception escaping a parser that must never raise, or a value that breaks its
contract; a hang is a parse that takes longer than ``HANG_S`` (a watchdog thread times every call). The socket
targets throw connections at a live listener (``Net``) and a live relay's control port (``RelayNet``), and the DHT
target stores what it makes in a real DHT.
The in-process targets, one per parser, are in ``diloco.bench.fuzz_parsers``.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from diloco.bench.fuzz_parsers import in_process_targets, record_targets
from diloco.bench.mutator import (
    HANG_S,
    MAX_STORED,
    Broken,
    Hung,
    Mutator,
    Refused,
    Tally,
    Target,
    Watchdog,
    fuzz_target,
)

# ---------------------------------------------------------------- a live listener, a live DHT


class _Recorder:
    """A socket that keeps a copy of what is sent through it (the seeds: requests and hellos as the code writes
    them); everything else goes to the socket."""

    def __init__(self, sock: socket.socket, sent: bytearray) -> None:
        self._sock, self.sent = sock, sent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def sendall(self, data: Any, *args: Any) -> None:
        self.sent += bytes(memoryview(data).cast("B"))
        self._sock.sendall(data, *args)

    def send(self, data: Any, *args: Any) -> int:
        sent = self._sock.send(data, *args)
        self.sent += bytes(memoryview(data).cast("B")[:sent])
        return sent


class Net:
    """A listener on loopback (as a rank's: a round registered on it, state downloads served open and keyed) and a
    second one for its groupmate. ``targets`` throws connections at the first: each input is a byte string sent
    whole then closed, sent and left open, or trickled; the listener must close each within ``handshake_s`` plus
    ``SLACK_S``. ``close`` then runs an honest round on it."""

    SLACK_S = 1.0
    NUMEL = 1000

    def __init__(self, handshake_s: float = 0.3) -> None:
        import torch

        from diloco.swarm.records.swarm_key import SwarmKey
        from diloco.swarm.rounds import transfer
        from diloco.swarm.rounds.layout import Shape, group_layout
        from diloco.swarm.rounds.listener import Listener, listen_socket

        self.handshake_s = handshake_s
        socks = [listen_socket("127.0.0.1", 0) for _ in range(2)]
        self.endpoints = [(["127.0.0.1"], sock.getsockname()[1]) for sock in socks]
        self.listeners = [Listener(sock, handshake_timeout=handshake_s).start() for sock in socks]
        shapes, key = [(64, 8), (8,)], SwarmKey(bytes(range(32)))
        layout = group_layout(shapes, Shape("NO_SHARD", 1))[0]
        state = ({"outer_step": 3, "step": 75, "digest": "ab" * 32, "tainted": False, "world_rank": 0},
                 [torch.zeros(layout.local_numel), torch.zeros(layout.local_numel)])  # fmt: skip
        for service_key in (None, key):
            service = transfer.StateService(layout, lambda: state, timeout=handshake_s, key=service_key)
            self.listeners[0].serve(service.magic, service)
        self.requests: list[bytes] = []
        for service_key in (None, key):  # a download from it, as a group that catches up asks
            sent = bytearray()
            transfer.download(layout, [layout], self.endpoints[:1], timeout=5, key=service_key,
                              connect=lambda e, t, h, sent=sent: _Recorder(socket.create_connection((e[0][0], e[1]), t),
                                                                           sent))  # fmt: skip
            self.requests.append(bytes(sent))
        self.group_id = b"fuzz-round" * 3
        self.hellos: list[bytes] = []
        self.honest = self.round(self.group_id, record=True)
        self.decoy = self._round(0, self.group_id, timeout=handshake_s)  # replays and forged hellos reach its checks
        self.listeners[0].register(self.decoy)

    def _round(self, index: int, group_id: bytes, timeout: float, sent: bytearray | None = None) -> Any:
        import torch

        from diloco.swarm.rounds import tcp
        from diloco.swarm.rounds.codecs import WIRE_FORMATS

        vector = torch.randn(self.NUMEL, generator=torch.Generator().manual_seed(index))

        def connect(endpoint: Any, timeout: float, handshake: Any) -> Any:
            sock = socket.create_connection((endpoint[0][0], endpoint[1]), timeout=timeout)
            return handshake(_Recorder(sock, sent)) if handshake is not None else sock

        return tcp.Round(vector, torch.empty_like(vector), group_id=group_id, index=index, endpoints=self.endpoints,
                         weight=1.0, codec=WIRE_FORMATS["int8"].tcp, timeout=timeout,
                         connect=tcp.connect if sent is None else connect)  # fmt: skip

    def round(self, group_id: bytes, record: bool = False) -> str:
        """One honest round of the two listeners' ranks (int8 parts): "completed", or why not."""
        sent = bytearray() if record else None
        rounds = [self._round(0, group_id, 5.0), self._round(1, group_id, 5.0, sent)]
        errors: list[str] = []

        def run(round_: Any) -> None:
            try:
                round_.run()
            except Exception as e:  # noqa: BLE001 - RoundFailed, or anything else: the outcome reported
                errors.append(f"{type(e).__name__}: {e}")

        for listener, round_ in zip(self.listeners, rounds):
            listener.register(round_)
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in rounds]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        for listener, round_ in zip(self.listeners, rounds):
            listener.unregister(round_)
        if sent:
            self.hellos.append(bytes(sent[:4096]))
        if any(thread.is_alive() for thread in threads):
            return "hung"
        if errors:
            return "; ".join(errors)[:500]
        return "completed" if bool((rounds[0].out == rounds[1].out).all()) else "outputs differ"

    def targets(self) -> list[Target]:
        make = make_connection
        return [Target("listener.round_hello", self.hellos or [b"DLB2"], make, self._send, weight=0.25),
                Target("listener.state_request", self.requests, make, self._send, weight=0.25)]  # fmt: skip

    def _send(self, value: tuple[bytes, str]) -> None:
        """One connection: the listener must close it by its bound, whatever was sent and however slowly."""
        throw((self.endpoints[0][0][0], self.endpoints[0][1]), value, self.handshake_s, self.handshake_s + self.SLACK_S)

    def close(self) -> dict[str, Any]:
        """An honest round on the fuzzed listener (a new group id), then everything closed; what it found."""
        self.decoy.abort()
        self.listeners[0].unregister(self.decoy)
        after = self.round(b"fuzz-honest" * 3)
        refused = self.listeners[0].refused
        for listener in self.listeners:
            listener.close()
        time.sleep(self.handshake_s)
        left = sum(t.name.startswith("butterfly") and t.is_alive() for t in threading.enumerate())
        return {"honest_round_before": self.honest, "honest_round": after, "listener_refused": refused,
                "listener_threads_left": left}  # fmt: skip


def make_connection(m: Mutator, seed: bytes) -> tuple[bytes, str]:
    """A mutated opening, sent whole then closed, sent and left open, or trickled."""
    mode = m.rng.choices(["close", "open", "trickle"], [0.9, 0.07, 0.03])[0]
    return m.bytes(seed), mode


def throw(address: tuple[str, int], value: tuple[bytes, str], pace_s: float, bound_s: float,
          answered: Any = None) -> None:  # fmt: skip
    """One connection to `address`: the server must close it within `bound_s`, whatever was sent and however slowly
    (`pace_s`: the trickle's pace) -- ``Refused``; or, where `answered(bytes)` says its answer is a valid one
    (a relay's lease), this side closes and it returns (accepted). ``Hung`` otherwise."""
    data, mode = value
    bound = time.monotonic() + bound_s
    heard = b""
    with socket.create_connection(address, timeout=1) as sock:
        try:
            if mode == "trickle":
                for i in range(len(data)):
                    if time.monotonic() > bound:
                        raise Hung(f"still reading a trickled connection after {i} bytes")
                    sock.sendall(data[i : i + 1])
                    time.sleep(pace_s / 4)
            else:
                sock.sendall(data)
            if mode == "close":
                sock.shutdown(socket.SHUT_WR)
            while time.monotonic() < bound:
                sock.settimeout(max(bound - time.monotonic(), 0.01))
                if not (chunk := sock.recv(2**16)):
                    raise Refused()
                heard += chunk
                if answered is not None and answered(heard):
                    return
        except (ConnectionError, socket.timeout, OSError) as e:
            if isinstance(e, socket.timeout):
                raise Hung(f"connection ({mode}) not closed within {bound_s} s") from None
            raise Refused() from None
        raise Hung(f"connection ({mode}) not closed within {bound_s} s")


class RelayNet:
    """A live relay on loopback (``diloco.swarm.relay``: ``diloco dht --relay-ports``) with four ports to lease.
    ``targets`` throws connections at its control port as ``Net`` does at the listener: the relay must close each
    within its hello timeout plus ``SLACK_S``, or grant a lease (which this side then ends: accepted). ``close``
    then checks that every port is free again and that an honest lease still carries a connection."""

    SLACK_S = 1.0
    PORTS = 4

    def __init__(self, hello_s: float = 0.3) -> None:
        from diloco.swarm.relay import protocol
        from diloco.swarm.relay.server import Relay

        self.hello_s = hello_s
        socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(1 + self.PORTS)]
        control, *ports = [sock.getsockname()[1] for sock in socks]
        for sock in socks:
            sock.close()
        self.relay = Relay("127.0.0.1", control, ports, hello_timeout=hello_s).start()
        request = json.dumps({"count": 1, "want": []}, separators=(",", ":")).encode()
        self.seeds = [protocol.LEASE + len(request).to_bytes(2, "big") + request,
                      protocol.DATA + bytes(range(protocol.ID_SIZE))]  # fmt: skip

    def targets(self) -> list[Target]:
        return [Target("relay.control", self.seeds, make_connection, self._send, weight=0.25)]

    def _send(self, value: tuple[bytes, str]) -> None:
        throw(("127.0.0.1", self.relay.control_port), value, self.hello_s, self.hello_s + self.SLACK_S, _granted)

    def close(self) -> dict[str, Any]:
        """Every port free again (within a second: the relay sees the fuzzer's leases end), an honest lease of all
        of them carrying a connection; then the relay closed. What it found."""
        deadline = time.monotonic() + 5
        while self.relay.free_ports < self.PORTS and time.monotonic() < deadline:
            time.sleep(0.05)
        free = self.relay.free_ports
        try:
            outcome = self._honest()
        except Exception as e:  # noqa: BLE001 - the outcome reported
            outcome = f"{type(e).__name__}: {e}"[:300]
        self.relay.close()
        return {"relay_ports_free_after": f"{free} of {self.PORTS}", "relay_honest_lease": outcome}

    def _honest(self) -> str:
        from diloco.swarm.relay.lease import Lease

        arrived: list[socket.socket] = []
        lease = Lease((["127.0.0.1"], self.relay.control_port), [lambda conn, _: arrived.append(conn)] * self.PORTS)
        try:
            with socket.create_connection((lease.host, lease.ports[-1]), timeout=5) as caller:
                caller.sendall(b"ping")
                deadline = time.monotonic() + 5
                while not arrived and time.monotonic() < deadline:
                    time.sleep(0.01)
                if not arrived:
                    return "no connection arrived"
                arrived[0].settimeout(5)
                got = arrived[0].recv(4)
                arrived[0].close()
                return "carried a connection" if got == b"ping" else f"carried {got!r}"
        finally:
            lease.close()


def _granted(heard: bytes) -> bool:
    """Whether a relay's answer (so far) is a lease granted: its length-prefixed JSON names ports."""
    if len(heard) < 2 or len(heard) < 2 + int.from_bytes(heard[:2], "big"):
        return False
    try:
        return isinstance(json.loads(heard[2 : 2 + int.from_bytes(heard[:2], "big")]).get("ports"), list)
    except (ValueError, AttributeError):
        return False


class _Bounded:
    """A DHT whose ``get`` answers within ``HANG_S`` or raises ``Hung`` (hivemind's blocking ``get`` waits for ever
    when its search fails inside the DHT process)."""

    def __init__(self, dht: Any) -> None:
        self.dht = dht

    def get(self, key: str, latest: bool = False) -> Any:
        try:
            return self.dht.get(key, latest=latest, return_future=True).result(timeout=HANG_S * 0.75)
        except TimeoutError:
            raise Hung(f"DHT get({key!r}) never answered") from None


class DhtTarget:
    """Malformed values stored in a real hivemind DHT (with the trainers' validator, signed by an owner as any
    stranger can sign its own) under a run's progress, status and token keys, then read back by each reader."""

    def __init__(self) -> None:
        from diloco.swarm.records.dht import start_dht
        from diloco.swarm.records.ownership import Owner

        self.owner = Owner.ephemeral()
        self.dht = start_dht(initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                             validator=self.owner.validator)  # fmt: skip
        self.count = 0

    def target(self) -> Target:
        from diloco.swarm.records import budget, progress, status

        seeds = [(f, t.seeds[0]) for t, f in zip(record_targets()[:3], ("progress", "status", "tokens"))]
        readers = {"progress": (progress.progress_key, progress.read), "status": (status.status_key, status.read),
                   "tokens": (budget.tokens_key, lambda dht, key: budget.parse(dht.get(key, latest=True)))}

        from hivemind.utils.serializer import MSGPackSerializer

        def make(m: Mutator, seed: tuple[str, Any]) -> tuple[str, str, list]:
            """Stores one to three malformed records under a new key (not timed: the DHT's own latency)."""
            kind, record = seed
            self.count += 1
            key = readers[kind][0](f"fuzz{self.count}")
            subkeys = [self.owner.subkey(3), self.owner.subkey(10**30), "3", self.owner.subkey(0) + "x"]
            stored = []
            for _ in range(m.rng.randint(1, 3)):
                value = m.value(record)
                try:
                    # what a peer can store stays far below this; a local store of megabytes breaks the DHT's pipe
                    if len(MSGPackSerializer.dumps(value)) > MAX_STORED:
                        continue
                    subkey = m.rng.choice(subkeys)
                    if self.dht.store(key, subkey=subkey, value=value, expiration_time=time.time() + 60):
                        stored.append((subkey[:12], value))
                except Exception:  # noqa: BLE001 - not serializable by hivemind (a huge int, a deep value): not stored
                    pass
            return kind, key, stored

        def call(value: tuple[str, str, list]) -> None:
            kind, key, _ = value
            got = readers[kind][1](_Bounded(self.dht), key)
            if not isinstance(got, list):
                raise Broken(f"read returned a {type(got).__name__}")
            if not got:
                raise Refused()

        return Target("dht.read", seeds, make, call, weight=0.05)

    def close(self) -> None:
        self.dht.shutdown()


# ---------------------------------------------------------------- the bench


def run_fuzz(inputs: int, seed: int, work_dir: Path, *, sockets: bool = True, dht: bool = True,
             hang_s: float = HANG_S) -> dict[str, Any]:  # fmt: skip
    """Throw about `inputs` inputs (seeded by `seed`) at every parser, in process; with `sockets`, at a live listener
    too (then an honest round must still complete on it); with `dht`, stored in a real DHT and read back. The
    result (also written to ``work_dir / "fuzz.json"``) has per target its inputs, accepted, refusals, crashes,
    hangs, seconds and examples, and the totals."""
    work_dir.mkdir(parents=True, exist_ok=True)
    started, load = time.monotonic(), os.getloadavg()
    rng = random.Random(seed)
    mutator, watchdog = Mutator(rng), Watchdog(hang_s)
    targets = in_process_targets()
    net = Net() if sockets else None
    targets += net.targets() if net is not None else []
    relay = RelayNet() if sockets else None
    targets += relay.targets() if relay is not None else []
    store = DhtTarget() if dht else None
    targets += [store.target()] if store is not None else []
    total = sum(t.weight for t in targets)
    tallies: dict[str, Tally] = {}
    try:
        for target in targets:
            count = max(1, math.ceil(inputs * target.weight / total))  # (at least `inputs` in all)
            mutator.rng = random.Random(f"{seed}:{target.name}")  # each target's inputs, whatever the others'
            tallies[target.name] = fuzz_target(target, count, mutator, watchdog)
    finally:
        after = net.close() if net is not None else {}
        after |= relay.close() if relay is not None else {}
        if store is not None:
            store.close()
    result: dict[str, Any] = {
        "seed": seed,
        "inputs": sum(t.inputs for t in tallies.values()),
        "crashes": sum(t.crashes for t in tallies.values()),
        "hangs": sum(t.hangs for t in tallies.values()),
        "hang_s": hang_s,
        "seconds": round(time.monotonic() - started, 1),
        "load_average": [round(x, 2) for x in load],
        "targets": {name: asdict(tally) for name, tally in tallies.items()},
        **after,
    }
    (work_dir / "fuzz.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


FULL_INPUTS, QUICK_INPUTS, BENCH_SEED = 100_000, 3_000, 20261127


def measure(quick: bool, work_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    """`diloco bench fuzz`: ``run_fuzz`` over 100,000 inputs (3,000 with ``--quick``), every target."""
    return run_fuzz(QUICK_INPUTS if quick else FULL_INPUTS, BENCH_SEED, work_dir)


def markdown(result: dict[str, Any]) -> str:
    """The result as a table: one row per target, then the totals and every crash and hang kept."""
    from diloco.bench import section_head

    head = "\n".join(section_head(result)) + "\n" if "machine" in result else ""
    lines = [
        f"{head}\n{result['inputs']:,} inputs (seed {result['seed']}) in {result['seconds']} s, "
        f"load average {result['load_average'][0]} at the start: **{result['crashes']} crashes, "
        f"{result['hangs']} hangs** (a parse over {result['hang_s']} s).\n",
        "| target | inputs | accepted | refusals | crashes | hangs | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t in result["targets"].items():
        lines.append(f"| `{name}` | {t['inputs']:,} | {t['accepted']:,} | {t['refusals']:,} | {t['crashes']} "
                     f"| {t['hangs']} | {t['seconds']} |")  # fmt: skip
    if "honest_round" in result:
        lines.append(f"\nAn honest round on the fuzzed listener afterwards: **{result['honest_round']}**.")
    if "relay_honest_lease" in result:
        lines.append(f"\nThe fuzzed relay afterwards: {result['relay_ports_free_after']} ports free; an honest lease "
                     f"**{result['relay_honest_lease']}**.")  # fmt: skip
    for name, t in result["targets"].items():
        for example in t["examples"]:
            lines.append(f"\n**{example['kind']}** in `{name}`: input `{example['input']}`\n\n```\n"
                         f"{example['error']}\n```")  # fmt: skip
    return "\n".join(lines) + "\n"



"""The fuzz bench: malformed, truncated, oversized, wrong-typed and deeply nested inputs thrown at every parser of
what peers send (DHT records, matchmaking announcements, sealed values, state metadata, the wire formats, framed
messages) and at a live listener, counting per target its inputs, refusals, crashes and hangs.

Inputs come from a seeded mutator started from valid examples, built the way the trainer builds them, so most of
them get past the first check. A refusal (None, False, or the ValueError a parser's contract names) is the expected
outcome; a crash is any other exception escaping a parser that must never raise, or a value that breaks its
contract; a hang is a parse that takes longer than ``HANG_S`` (a watchdog thread times every call). The socket
targets throw connections at a live listener (``Net``), and the DHT target stores what it makes in a real DHT.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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

# ---------------------------------------------------------------- the parsers in process


def refuse_none(parse: Callable[[Any], Any], kind: type | None = None) -> Callable[[Any], None]:
    """A parser whose contract is "the record, or None": None is a refusal, anything but a `kind` breaks it."""

    def call(value: Any) -> None:
        parsed = parse(value)
        if parsed is None or parsed is False:
            raise Refused()
        if kind is not None and not isinstance(parsed, kind):
            raise Broken(f"returned a {type(parsed).__name__}")

    return call


class _Answers:
    """A DHT whose ``get`` answers whatever it was given: the ``read`` functions' view of a hostile DHT."""

    def __init__(self, found: Any) -> None:
        self.found = found

    def get(self, key: str, latest: bool = False) -> Any:
        return self.found


MARKER = "[owner:-----BEGIN PUBLIC KEY-----\nMIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEA\n-----END PUBLIC KEY-----]"


def found_of(records: Iterable[tuple[Any, Any]]) -> SimpleNamespace:
    """A ``get(key, latest=True)`` answer of hivemind's DHT: subkey -> value with its expiry."""
    expires = time.time() + 60
    return SimpleNamespace(value={subkey: SimpleNamespace(value=value, expiration_time=expires)
                                  for subkey, value in records}, expiration_time=expires)  # fmt: skip


def mutate_found(m: Mutator, seed: SimpleNamespace) -> Any:
    """An answer with its subkeys, entries or records changed (or no answer of the right form at all)."""
    r = m.rng
    move = r.randrange(10)
    if move == 0:
        return m.nasty()
    if move == 1:
        return SimpleNamespace(value=m.nasty())
    entries = dict(seed.value)
    subkey = r.choice(list(entries))
    if move in (2, 3):  # a subkey another peer might sign: any rank, any form
        new = r.choice(["9" * 20 + MARKER, "9" * 5000 + MARKER, "-1" + MARKER, "٣" + MARKER, "0[owner:]", "3", 3,
                        b"3" + MARKER.encode(), None, "3" + MARKER + "x", " 3" + MARKER,
                        "0" * 400 + "3" + MARKER])  # fmt: skip
        entries[new] = entries.pop(subkey)
    elif move == 4:
        entries[subkey] = m.nasty()  # an entry without a value
    else:
        entry = entries[subkey]
        entries[subkey] = SimpleNamespace(value=m.value(entry.value), expiration_time=entry.expiration_time)
    return SimpleNamespace(value=entries, expiration_time=seed.expiration_time)


def record_targets() -> list[Target]:
    """The DHT records (progress, status, round tokens): each ``from_dict`` and each ``read`` over owned entries."""
    from diloco.swarm.records import budget, progress, status

    world, peer = 3, "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    records = [
        progress.Progress(world_rank=world, outer_step=7, step=175, digest="ab" * 32, tainted=False, settled=True,
                          token="f" * 32, peers=(peer, peer), done=False, shape=("FULL_SHARD", 2, 1),
                          endpoints=((["127.0.0.1", "10.0.0.2"], 40001), (["127.0.0.1"], 40002))).to_dict(),
        progress.Progress(world_rank=0, outer_step=0, step=0, digest="", tainted=True, settled=False, token="t",
                          peers=(peer,)).to_dict(),
    ]  # fmt: skip
    statuses = [
        status.Status(world_rank=world, ranks=2, sharding="FULL_SHARD", state="training", step=25, max_steps=30,
                      outer_step=5, tokens_per_s=1234.5, digest="0123456789abcdef", round_peers=2,
                      round_at=1.8e9, heard_at=1.8e9 + 3, model="m" * 16, parameters=124_000_000, peer=peer,
                      transport="tcp", outer="0.7/0.9 w1", schedule="200 steps, H 25", batch="16x128").to_dict(),
        status.Status(world_rank=0, ranks=1, sharding="NO_SHARD", state="joining", step=0, max_steps=None,
                      outer_step=0, tokens_per_s=None, digest="", round_peers=None, round_at=None,
                      heard_at=1.8e9).to_dict(),
    ]  # fmt: skip
    tokens = [budget.RoundTokens(world_rank=world, outer_step=5, tokens=40960, tokens_per_s=2048.0, at=1.8e9).to_dict(),
              budget.RoundTokens(world_rank=0, outer_step=0, tokens=0, tokens_per_s=0.0, at=0.0, closed=True).to_dict()]
    owned = [found_of([(f"{world}{MARKER}", r), (f"{world + 1}{MARKER}", r), ("5", r)]) for r in records]
    owned_status = [found_of([(f"{world}{MARKER}", s)]) for s in statuses]
    owned_tokens = [found_of([(f"{world}{MARKER}", t), (f"0{MARKER}", t)]) for t in tokens]

    def reads(read: Callable[..., list]) -> Callable[[Any], None]:
        def call(found: Any) -> None:
            refused: list = []
            got = read(_Answers(found), "key", lambda owner, rank: refused.append(rank))
            if not isinstance(got, list):
                raise Broken(f"read returned a {type(got).__name__}")
            if not got:
                raise Refused()

        return call

    def value(m: Mutator, seed: Any) -> Any:
        return m.value(seed)

    return [
        Target("progress.from_dict", records, value, refuse_none(progress.Progress.from_dict, progress.Progress)),
        Target("status.from_dict", statuses, value, refuse_none(status.Status.from_dict, status.Status)),
        Target("budget.RoundTokens.from_dict", tokens, value,
               refuse_none(budget.RoundTokens.from_dict, budget.RoundTokens)),
        Target("progress.read", owned, mutate_found, reads(progress.read)),
        Target("status.read", owned_status, mutate_found, reads(status.read)),
        Target("budget.parse", owned_tokens, mutate_found,
               reads(lambda dht, key, refused: budget.parse(dht.get(key, latest=True), refused))),
    ]  # fmt: skip


def sealed_targets() -> list[Target]:
    """The swarm key's sealed records and announcements: garbage seals, and bodies that a key holder sealed (a
    member's bug, or a hostile member) which must still parse safely."""
    from diloco.swarm.records.swarm_key import BODY_FIELD, MAC_FIELD, SwarmKey
    from diloco.swarm.rounds.group_round import announced

    key = SwarmKey(bytes(range(32)))
    record = {"world_rank": 1, "outer_step": 2, "peers": ["p"], "sealed_until": 1.8e9}
    subkey = f"1{MARKER}"
    announcement = {"shape": ["FULL_SHARD", 2, 1], "endpoints": [[["127.0.0.1"], 4001], [["10.0.0.2"], 4002]],
                    "weight": 1.0}  # fmt: skip
    context = (b"round-7", b"peer-id")

    def sealed(m: Mutator, seed: Any, purpose: str, context: tuple[bytes, ...]) -> dict[str, Any]:
        sealed = key.seal("key", subkey, seed, 1.8e9) if purpose == "record" else key.sign_member(seed, *context)
        move = m.rng.randrange(4)
        if move == 0:
            return m.value(sealed)  # another form, a wrong MAC: refused before the body is read
        body = (m.json(seed), m.bytes(sealed[BODY_FIELD]), m.number(sealed[BODY_FIELD]))[move - 1]
        return {BODY_FIELD: body, MAC_FIELD: m.rng.choice([key.mac(purpose, *context, body).hex(),
                                                           key.mac(purpose, *context, body)])}  # fmt: skip

    def opened(value: dict[str, Any]) -> None:
        got = key.opened("key", subkey, value["sealed"], value["expires"])
        if got is None:
            raise Refused()
        if not isinstance(got, dict):
            raise Broken(f"opened a {type(got).__name__}")

    def make_record(m: Mutator, seed: Any) -> dict[str, Any]:
        expires = m.rng.choice([1.8e9, 1.8e9 + 1, float("nan"), float("inf"), 0.0])
        return {"sealed": sealed(m, seed, "record", ("key".encode(), subkey.encode())), "expires": expires}

    def member(value: dict[str, Any]) -> None:
        got = key.member_signed(value, *context)
        if got is None:
            raise Refused()
        if announced(got) is None:  # what matchmaking does next with it
            raise Refused()

    return [
        Target("swarm_key.opened", [record, {"a": 1}], make_record, opened),
        Target("swarm_key.member_signed", [announcement], lambda m, s: sealed(m, s, "member", context), member),
        Target("group_round.announced", [announcement, {**announcement, "weight": 0}],
               lambda m, s: m.value(s), refuse_none(announced)),
    ]  # fmt: skip


def meta_targets() -> list[Target]:
    """A downloaded state's metadata: the JSON header (``transfer._meta``) and the outer loop's rules for its fields
    (``catchup.META``)."""
    from diloco.outer.catchup import META
    from diloco.swarm.rounds import transfer

    meta = {"outer_step": 7, "step": 175, "digest": "ab" * 32, "tainted": False, "world_rank": 2}

    def parse(header: bytes) -> None:
        got = transfer._meta(header)
        if not isinstance(got, dict):
            raise Broken(f"metadata of type {type(got).__name__}")

    def rules(value: Any) -> None:
        typed = isinstance(value, dict) and all(value.get(name) is not None and valid(value[name])
                                                for name, valid in META.items())  # fmt: skip
        if not typed:
            raise Refused()

    return [
        Target("transfer._meta", [meta], lambda m, s: m.json(s), parse, refusals=(ValueError,)),
        Target("catchup.META", [meta], lambda m, s: m.value(s), rules),
    ]


def codec_targets() -> list[Target]:
    """Every wire format's decoder: exactly n float32 values without grad, or a ValueError."""
    import warnings

    import torch

    from diloco.swarm.rounds.codecs import WIRE_FORMATS

    targets = []
    for name, wire in WIRE_FORMATS.items():
        codec = wire.tcp
        seeds = []
        for n in (1, 64, 100, 1000):
            values = torch.randn(n, generator=torch.Generator().manual_seed(n))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # hivemind's 8-bit encoder uses a deprecated torch call
                seeds.append((bytes(memoryview(codec.encode(values)).cast("B")), n))

        def make(m: Mutator, seed: tuple[bytes, int], name: str = name) -> tuple[bytes, int]:
            data, n = seed
            if m.rng.random() < 0.1:
                n = m.rng.choice([n - 1, n + 1, 2 * n, 1])
            if name == "int8" and m.rng.random() < 0.3:  # a well-formed message whose header lies
                return _int8_header(m, data), max(n, 1)
            return m.bytes(data), max(n, 1)

        def decode(value: tuple[bytes, int], codec: Any = codec) -> None:
            data, n = value
            decoded = codec.decode(memoryview(bytearray(data)), n)
            if not (isinstance(decoded, torch.Tensor) and decoded.dtype == torch.float32 and decoded.dim() == 1
                    and decoded.numel() == n and not decoded.requires_grad):  # fmt: skip
                raise Broken(f"decoded {getattr(decoded, 'dtype', type(decoded))} {getattr(decoded, 'shape', '')}"
                             f" requires_grad={getattr(decoded, 'requires_grad', '')} for {n} values")  # fmt: skip

        targets.append(Target(f"codec.{name}", seeds, make, decode, refusals=(ValueError,)))
    return targets


def _int8_header(m: Mutator, data: bytes) -> bytes:
    """An int8 part with its dtype, size, gradient flag or codebook length changed."""
    from hivemind.proto import runtime_pb2

    message = runtime_pb2.Tensor.FromString(data)
    move = m.rng.randrange(4)
    if move == 0:
        message.dtype = m.rng.choice(["float64", "int64", "float16", "bool", "Tensor", "", "x" * 100])
    elif move == 1:
        sizes = [[], [0], [-1], [2**40], [len(message.buffer)], [10, 10], list(message.size) * 2]
        del message.size[:]
        message.size.extend(m.rng.choice(sizes))
    elif move == 2:
        message.requires_grad = True
    else:
        levels = m.rng.choice([0, -1, 257, 2**60, -(2**63), 1])
        message.buffer = levels.to_bytes(8, "little", signed=True) + message.buffer[8:]
    return message.SerializeToString()


def frames_target() -> Target:
    """``Frames.receive`` over a socketpair: a framed message (plain or sealed), mutated, then the sender closes."""
    from diloco.swarm.rounds.frames import LENGTH, Frames, PastDeadline, seal_keys

    keys = seal_keys(b"k" * 32, b"context")
    seeds = [(LENGTH.pack(len(body)) + body, sealed) for body in (b"", b"x" * 100, bytes(4000)) for sealed in (0, 1)]
    sealed_seeds = []
    for body in (b"", b"y" * 100):
        a, b = socket.socketpair()
        with a, b:
            Frames(a, send_key=keys[0]).send(body)
            sealed_seeds.append((b.recv(65536), 1))
    seeds = [s for s in seeds if not s[1]] + sealed_seeds

    def make(m: Mutator, seed: tuple[bytes, int]) -> tuple[bytes, int, bool]:
        return m.bytes(seed[0]), seed[1], m.rng.random() < 0.02  # a few stay open: the deadline must end them

    def receive(value: tuple[bytes, int, bool]) -> None:
        data, sealed, stay_open = value
        a, b = socket.socketpair()
        with a, b:
            a.sendall(data[: 2**16])  # within the pair's buffer: the writer never blocks
            if not stay_open:
                a.shutdown(socket.SHUT_WR)
            frames = Frames(b, receive_key=keys[0] if sealed else None, deadline=time.monotonic() + 0.2)
            got = frames.receive(8192)
            if got.nbytes > 8192:
                raise Broken(f"a message of {got.nbytes} bytes past its bound")

    return Target("frames.receive", seeds, make, receive, refusals=(ValueError, ConnectionError, PastDeadline),
                  weight=0.3)  # fmt: skip


def in_process_targets() -> list[Target]:
    return record_targets() + sealed_targets() + meta_targets() + codec_targets() + [frames_target()]


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
        make = self._make
        return [Target("listener.round_hello", self.hellos or [b"DLB2"], make, self._send, weight=0.25),
                Target("listener.state_request", self.requests, make, self._send, weight=0.25)]  # fmt: skip

    def _make(self, m: Mutator, seed: bytes) -> tuple[bytes, str]:
        mode = m.rng.choices(["close", "open", "trickle"], [0.9, 0.07, 0.03])[0]
        return m.bytes(seed), mode

    def _send(self, value: tuple[bytes, str]) -> None:
        """One connection: the listener must close it by its bound, whatever was sent and however slowly."""
        data, mode = value
        bound = time.monotonic() + self.handshake_s + self.SLACK_S
        with socket.create_connection((self.endpoints[0][0][0], self.endpoints[0][1]), timeout=1) as sock:
            try:
                if mode == "trickle":
                    for i in range(len(data)):
                        if time.monotonic() > bound:
                            raise Hung(f"still reading a trickled connection after {i} bytes")
                        sock.sendall(data[i : i + 1])
                        time.sleep(self.handshake_s / 4)
                else:
                    sock.sendall(data)
                if mode == "close":
                    sock.shutdown(socket.SHUT_WR)
                while time.monotonic() < bound:
                    sock.settimeout(max(bound - time.monotonic(), 0.01))
                    if not sock.recv(2**16):
                        raise Refused()
            except (ConnectionError, socket.timeout, OSError) as e:
                if isinstance(e, socket.timeout):
                    raise Hung(f"connection ({mode}) not closed within {self.handshake_s + self.SLACK_S} s") from None
                raise Refused() from None
            raise Hung(f"connection ({mode}) not closed within {self.handshake_s + self.SLACK_S} s")

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
    for name, t in result["targets"].items():
        for example in t["examples"]:
            lines.append(f"\n**{example['kind']}** in `{name}`: input `{example['input']}`\n\n```\n"
                         f"{example['error']}\n```")  # fmt: skip
    return "\n".join(lines) + "\n"



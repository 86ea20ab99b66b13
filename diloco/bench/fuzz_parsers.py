"""The fuzz bench's in-process targets (``diloco.bench.fuzz``): every parser of what peers send, each with valid
examples built the way the trainer builds them: DHT records, sealed values, matchmaking announcements, state
metadata, the wire formats and framed messages. Each target names what a refusal is and what breaks its contract.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

from diloco.bench.mutator import (
    Broken,
    Mutator,
    Refused,
    Target,
)


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

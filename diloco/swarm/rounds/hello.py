"""The hello that opens a round's connection (``diloco.swarm.rounds.tcp``): what it carries, how a sender signs it
and how a reducer checks it.

Two checks, cheap first. The MAC (HMAC-SHA256 keyed with the round's group id, which only the group's members know)
keeps strangers out before any signature work. The signature (Ed25519, with the key the sender's group announced for
that rank in matchmaking: ``Roster``) makes each member speak for itself: a member that knows the group id cannot
connect as another sender index, since it holds no other rank's private key. The signed fields bind the hello to
one round (its tag and the digest of its announcements as the sender saw them), one (sender, reducer) pair, one
schedule and codec, the sender's weight, and a fresh nonce of the sender's, which also enters the ack and the
sealed connection's keys: no two connections share keys, even when a group id repeats, and an ack recorded on an
earlier connection fails on a new one.

What a hostile matchmaking leader can still do: hivemind relays the gathered announcements through it, so it may
drop groups, add groups of its own (sybils, each with keys and a weight it chooses, capped like any), repeat a group
id, or show the other members one member's announcement altered (keys, endpoints, weight) while showing that member
the original: in the others' round the member is then the leader's sybil, and the member's own connections are
refused (its digest differs), so its round fails. Members that read different lists refuse each other: it can split
a round or replace a member, not make members average under different views, nor sign for an index whose key it did
not announce. What its sybils send, the reducer's rules bound (the norm screen, robust aggregation, the weight cap,
all judged against medians) while they are fewer than the honest members.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from diloco.swarm.rounds import frames
from diloco.swarm.rounds.frames import recv_exact, send_all

MAGIC = b"DLB2"
NONCE_SIZE = 16  # the sender's fresh nonce
DIGEST_SIZE = 32  # the digest of the round's announcements (``Roster.digest``)
KEY_SIZE = 32  # a raw Ed25519 public key
SIGNATURE_SIZE = 64
# magic, tag (first 16 bytes of sha256(group id)), sender index, reducer index, group size, the first 16 bytes of the
# schedule's digest, codec name, sender's weight, sender's nonce, digest of the announcements, signature of all before
HELLO = struct.Struct(f"!4s16sHHH16s8sd{NONCE_SIZE}s{DIGEST_SIZE}s{SIGNATURE_SIZE}s")
SIGNED = HELLO.size - SIGNATURE_SIZE  # the signature covers every field before it
MAC_SIZE = 32  # HMAC-SHA256 of the fields, signature included, keyed with the group id
NO_DIGEST = bytes(DIGEST_SIZE)  # a round without a roster
NO_SIGNATURE = bytes(SIGNATURE_SIZE)


def mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def public_bytes(key: Ed25519PrivateKey) -> bytes:
    """The raw 32 bytes of `key`'s public half: what a group announces for the rank that holds `key`."""
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


@dataclass(frozen=True)
class Roster:
    """Who speaks for each participant of a round and with what weight, as matchmaking announced it and this
    participant read it (participants numbered group by group, rank by rank, as ``layout.plan_schedule`` does).

    :param keys: per participant, the raw Ed25519 public key its group announced for that rank.
    :param weights: per participant, its group's announced weight after the cap (``screening.capped_weights``): what
        a reducer counts its contributions with, whatever its hello says.
    :param digest: 32 bytes hashing the round's announcements as this participant read them; a sender whose digest
        differs saw another list (a matchmaking leader that showed members different ones) and is refused.
    """

    keys: tuple[bytes, ...]
    weights: tuple[float, ...]
    digest: bytes

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.weights) or len(self.digest) != DIGEST_SIZE:
            raise ValueError("a roster needs one key and one weight per participant, and a 32-byte digest")


@dataclass(frozen=True)
class Hello:
    """A hello's fields, signature and MAC aside."""

    tag: bytes
    sender: int
    reducer: int
    k: int
    schedule: bytes
    codec: bytes
    weight: float
    nonce: bytes
    digest: bytes


def new_hello(tag: bytes, sender: int, reducer: int, k: int, schedule: bytes, codec: str, weight: float,
              digest: bytes = NO_DIGEST) -> Hello:  # fmt: skip
    """A sender's hello to `reducer`, with a fresh nonce."""
    return Hello(tag, sender, reducer, k, schedule, codec.encode(), weight, os.urandom(NONCE_SIZE), digest)


def pack(hello: Hello, group_id: bytes, signer: Ed25519PrivateKey | None) -> bytes:
    """The hello's bytes on the wire: fields, signature (zeros without `signer`), MAC keyed with `group_id`."""
    fields = HELLO.pack(MAGIC, hello.tag, hello.sender, hello.reducer, hello.k, hello.schedule, hello.codec,
                        hello.weight, hello.nonce, hello.digest, NO_SIGNATURE)[:SIGNED]  # fmt: skip
    signed = fields + (signer.sign(fields) if signer is not None else NO_SIGNATURE)
    return signed + mac(group_id, signed)


def unpack(data: bytes, group_id: bytes) -> tuple[Hello, bytes]:
    """(the fields, the signature) of a hello whose MAC under `group_id` holds; ``ConnectionError`` otherwise."""
    if len(data) != HELLO.size + MAC_SIZE:
        raise ConnectionError(f"a hello of {len(data)} bytes")
    signed, tag = data[: HELLO.size], data[HELLO.size :]
    if not hmac.compare_digest(tag, mac(group_id, signed)):
        raise ConnectionError("hello with a wrong MAC")
    magic, *fields, signature = HELLO.unpack(signed)
    if magic != MAGIC:
        raise ConnectionError(f"hello of another version ({magic!r})")
    tag_, sender, reducer, k, schedule, codec, weight, nonce, digest = fields
    return Hello(tag_, sender, reducer, k, schedule, codec.rstrip(b"\0"), weight, nonce, digest), signature


def verify(data: bytes, signature: bytes, key: bytes) -> None:
    """Check a hello's signature (`data`: the hello's bytes) against a participant's announced public `key`."""
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(signature, data[:SIGNED])
    except (InvalidSignature, ValueError) as e:
        raise ConnectionError("hello not signed by the key announced for its sender") from e


def greet(sock: socket.socket, hello: bytes, group_id: bytes, sealed: bool, deadline: float) -> bytes:
    """Send `hello` and check the reducer's ack (``answer``); returns the reducer's nonce (empty unless `sealed`)."""
    send_all(sock, hello, deadline)
    ack = bytearray((frames.NONCE_SIZE if sealed else 0) + MAC_SIZE)
    recv_exact(sock, memoryview(ack), deadline)
    nonce, tag = bytes(ack[:-MAC_SIZE]), bytes(ack[-MAC_SIZE:])
    if not hmac.compare_digest(tag, mac(group_id, b"ack" + hello + nonce)):
        raise ConnectionError("the peer answered with a wrong MAC")
    return nonce


def answer(sock: socket.socket, hello: bytes, group_id: bytes, sealed: bool, deadline: float) -> bytes:
    """Ack an accepted `hello`: a fresh nonce when `sealed`, then the MAC of ``b"ack" + hello + nonce``. The hello
    holds the sender's own fresh nonce, so an ack recorded on another connection never passes. Returns the nonce."""
    nonce = os.urandom(frames.NONCE_SIZE) if sealed else b""
    send_all(sock, nonce + mac(group_id, b"ack" + hello + nonce), deadline)
    return nonce


def accept(data: bytes, group_id: bytes, expected: Hello, roster: Roster | None) -> tuple[int, float]:
    """(sender index, weight to count it with) of a hello a reducer received, or ``ConnectionError``: its MAC (first:
    strangers are out before any signature work), then its round, reducer, group size, schedule and codec against
    `expected` (whose reducer is the receiving peer), then, with a `roster`, its announcements' digest, its signature
    by the key announced for its sender, and its weight against the announced one."""
    hello, signature = unpack(data, group_id)
    sender = hello.sender
    fields = (hello.tag, hello.reducer, hello.k, hello.schedule, hello.codec)
    if fields != (expected.tag, expected.reducer, expected.k, expected.schedule, expected.codec) or not (
        0 <= sender < hello.k and sender != expected.reducer
    ):
        raise ConnectionError(f"hello {(sender, *fields[1:3], hello.schedule.hex(), hello.codec)} not of this round")
    if roster is None:
        return sender, hello.weight
    if hello.digest != roster.digest:
        raise ConnectionError(f"sender {sender} read other announcements for this round than this reducer")
    verify(data, signature, roster.keys[sender])
    if hello.weight != roster.weights[sender]:
        raise ConnectionError(f"sender {sender} claims weight {hello.weight:g}, announced {roster.weights[sender]:g}")
    return sender, roster.weights[sender]

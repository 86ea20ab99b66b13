"""A misbehaving worker group for the fault tests: it joins the swarm like a one-rank group (over TCP: its rank 0
matchmakes for the group) and, in every round, sends

- ``nan``: a pseudo-gradient full of NaN, as a trainer with a broken NaN check would;
- ``flip50``: -50 times the average the swarm sent it in the round before (zeros in the first): a sign-flipped,
  scaled copy of the honest pseudo-gradient, under the norm screen's 100x. It reduces its own spans honestly,
  with the swarm's ``--hv.aggregation`` (a hostile reducer is another attack);
- ``frame``: nothing: to each reducer it sends, past the handshake, a length header claiming 2**40 bytes and
  then waits; its own span it reduces honestly (its contribution there: zeros);
- ``frames``: a bad connection to each reducer, another in each round it is matched in, in turn (``FRAMES``):
  the 2**40-byte header; ``short``: a part of 12 bytes; ``slowloris``: the handshake, then nothing, holding the
  connection open; ``replay``: the hello it sent that reducer in an earlier round, replayed as recorded, then its
  parts as then. Its own span it reduces honestly.
- ``heavy``: announces a weight of 1e30 in matchmaking (and in its hellos) and sends minus the swarm's last average:
  every member caps it at ``screening.MAX_WEIGHT_RATIO`` times the median weight, and a reducer refuses a hello
  that claims more than the capped weight;
- ``impostor``: before its honest exchange with each reducer, connects to it as every other sender index of the
  round (its hellos signed with its own key, the round's group id and digest right), sending a part of zeros on
  each connection that is answered; prints "impostor: answered as #i" or "refused as #i" per try.

While it takes part in rounds it keeps a status record of a training group fresh, as a group that joined would:
honest groups count it among those expected in a round and wait (up to their matchmaking time) for it, instead of
meeting it only when it happens to be matchmaking as they do.

or, taking part in no round:

- ``forge``: for ROUNDS seconds, a progress record in the DHT that claims its group (WORLD_RANK) holds outer step
  10**6, naming a listener of its own that answers every state download with metadata saying so and then a
  state of the wrong size (8 bytes of values, then it hangs up);
- ``claim``: for ROUNDS seconds, against the running group that holds WORLD_RANK: that group's progress record
  stored again under the group's own subkey, altered (outer step 10**6, naming the listener above) with a later
  expiry; the same under the plain subkey "<world rank>" (no owner); and a record of this peer's own claiming the
  world rank (the group's token copied; outer step 0, not settled). Its DHT peer signs its own records and checks
  nobody's, as an attacker's would;
- ``malformed``: for ROUNDS seconds, every 2 s, entries of its own (signed, under WORLD_RANK) that are not records:
  a progress record that is settled at outer step 10**6 with no peer id, one whose outer step is a string and one
  whose digest and token are lists; a status record whose fields have the wrong types; a round-token record of
  another form.

Usage: python -m tests.support.hostile_peer ATTACK MODEL_DIR RUN_ID GALAXY_SIZE WORLD_RANK ROUNDS AGGREGATION
INITIAL_PEER...
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import torch
from hivemind.dht.crypto import RSASignatureValidator

from diloco.model import load_model
from diloco.swarm.records import status
from diloco.swarm.records.addresses import announced_hosts
from diloco.swarm.records.budget import tokens_key
from diloco.swarm.records.dht import rendezvous, start_dht
from diloco.swarm.records.fingerprint import ModelId, model_id, run_key
from diloco.swarm.records.ownership import Owner
from diloco.swarm.records.progress import Progress, progress_key, publish
from diloco.swarm.rounds import hello as hellos
from diloco.swarm.rounds import transfer
from diloco.swarm.rounds.codecs import WIRE_FORMATS
from diloco.swarm.rounds.frames import LENGTH, recv_exact
from diloco.swarm.rounds.group_round import GroupRounds
from diloco.swarm.rounds.layout import Shape
from diloco.swarm.rounds.listener import Listener, listen_socket
from diloco.swarm.rounds.matchmaker import Matchmaker
from diloco.swarm.rounds.tcp import Round

HEAVY = 1e30  # the `heavy` attacker's announced weight
MATCHMAKING_S = 8  # as the honest groups of the test: long enough under load for all three to gather
AVERAGING_S = 15


FRAMES = ("huge", "short", "slowloris", "replay")
recorded: dict[int, bytes] = {}  # reducer index -> the hello this peer sent it last (what `replay` replays)
bad_frame = ["huge"]  # the attack of this round's connections


def bad_frames(self: Round, reducer: int) -> None:
    """In place of ``Round._exchange``: the connection ``bad_frame[0]`` says to `reducer`, and no honest part."""
    attack, old = bad_frame[0], recorded.get(reducer)
    recorded[reducer] = own_hello(self, self.index, reducer)  # this round's, for a later replay
    try:
        if attack == "replay" and old is not None:
            sock = socket.create_connection(tuple_of(self.endpoints[reducer]), timeout=5)
            sock.sendall(old + LENGTH.pack(4 * 2**18) + bytes(4 * 2**18))  # an earlier round's opening, as sent
            sock.settimeout(self.timeout + 2.0)
            try:
                answer = sock.recv(1)  # b"": dropped
            except TimeoutError:  # held while the listener waits for a round of that tag to start
                answer = b""
            print(f"replay to reducer #{reducer}: {'answered' if answer else 'unanswered'}", flush=True)
        else:
            sock = self._connect(reducer)
            if attack == "huge":
                sock.sendall(LENGTH.pack(2**40))
            elif attack == "short":
                sock.sendall(LENGTH.pack(12) + bytes(12))
        time.sleep(self.timeout + 2.0)  # slowloris: silent past the reducer's patience; the others: hang up late
        sock.close()
    except OSError:
        pass
    self._fail(f"reducer #{reducer}: sent it a bad connection ({attack})")


def own_hello(self: Round, sender: int, reducer: int) -> bytes:
    """A hello of `sender` to `reducer` in this round, signed with this peer's own key (right for its index only)."""
    fields = hellos.new_hello(self.tag, sender, reducer, self.k, self.digest, self.codec.name,
                              self.roster.weights[sender], self.roster.digest)  # fmt: skip
    return hellos.pack(fields, self.group_id, self.signer)


honest_exchange = Round._exchange


def impostor(self: Round, reducer: int) -> None:
    """In place of ``Round._exchange``: try to connect to `reducer` as each other sender, then exchange honestly."""
    for sender in range(self.k):
        if sender in (self.index, reducer):
            continue
        try:
            with socket.create_connection(tuple_of(self.endpoints[reducer]), timeout=5) as sock:
                sock.sendall(own_hello(self, sender, reducer))
                sock.settimeout(self.timeout)
                answered = sock.recv(1) != b""
                if answered:
                    sock.sendall(LENGTH.pack(4 * 2**18) + bytes(4 * 2**18))
        except OSError:
            answered = False
        print(f"impostor: {'answered' if answered else 'refused'} as #{sender} by reducer #{reducer}", flush=True)
    honest_exchange(self, reducer)


def tuple_of(endpoint) -> tuple[str, int]:
    hosts, port = endpoint
    return hosts[0], port


def huge_frames(self: Round, reducer: int) -> None:
    """In place of ``Round._exchange``: a length header of 2**40 bytes to `reducer`, and no part."""
    try:
        sock = self._connect(reducer)
        sock.sendall(LENGTH.pack(2**40))
        time.sleep(2.0)  # long enough for the reducer to read the header; then hang up
        sock.close()
    except OSError:
        pass
    self._fail(f"reducer #{reducer}: sent it a 2**40-byte header")


FORGED_STEP = 10**6


def wrong_size_server(world_rank: int) -> socket.socket:
    """A listener that answers every state download with metadata claiming outer step 10**6 and 8 bytes of values
    (then hangs up), printing a line per answer; closing it ends the attack."""
    server = socket.create_server(("127.0.0.1", 0))
    served = []

    def answer() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed: the attack is over
            with conn:
                try:
                    request = bytearray(len(transfer.MAGIC) + transfer.COUNT.size)
                    recv_exact(conn, memoryview(request))
                    (count,) = transfer.COUNT.unpack_from(request, len(transfer.MAGIC))
                    recv_exact(conn, memoryview(bytearray(count * transfer.RUN.size)))
                    meta = {"outer_step": FORGED_STEP, "step": 100 * FORGED_STEP, "digest": "f" * 64,
                            "tainted": False, "world_rank": world_rank}  # fmt: skip
                    header = json.dumps(meta).encode()
                    conn.sendall(transfer.COUNT.pack(len(header)) + header + transfer.TENSORS.pack(1) + bytes(8))
                    served.append(1)
                    print(f"answered state download {len(served)} with 8 bytes of values", flush=True)
                except (OSError, ValueError):
                    pass

    threading.Thread(target=answer, daemon=True).start()
    return server


def forge(dht, owner: Owner, run: str, world_rank: int, seconds: float) -> None:
    """The ``forge`` attack: a record of its own claiming outer step 10**6, refreshed every 2 s, and a listener
    behind it that answers state downloads with the wrong size."""
    server = wrong_size_server(world_rank)
    hosts = announced_hosts(dht.get_visible_maddrs())
    record = Progress(world_rank=world_rank, outer_step=FORGED_STEP, step=100 * FORGED_STEP, digest="f" * 64,
                      tainted=False, settled=True, token=uuid.uuid4().hex, peers=(dht.peer_id.to_base58(),),
                      shape=("FULL_SHARD", 1, 1), endpoints=([hosts, server.getsockname()[1]],))  # fmt: skip
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            publish(dht, progress_key(run), record, owner.subkey(world_rank))
            print(f"forged a record of outer step {FORGED_STEP}", flush=True)
            time.sleep(2.0)
    finally:
        server.close()


class Lenient(RSASignatureValidator):
    """Signs this peer's own records and lets everyone's through: an attacker's DHT peer checks nothing."""

    def validate(self, record) -> bool:
        return True


def claim(dht, owner: Owner, run: str, world_rank: int, seconds: float) -> None:
    """The ``claim`` attack (see the module's docstring), once a second."""
    server = wrong_size_server(world_rank)
    hosts, key = announced_hosts(dht.get_visible_maddrs()), progress_key(run)
    print(f"watching for the record of group {world_rank}", flush=True)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            found = dht.get(key, latest=True)
            entries = found.value.items() if found is not None and isinstance(found.value, dict) else []
            for subkey, entry in entries:
                held = entry.value if isinstance(entry.value, dict) else {}
                if held.get("world_rank") != world_rank or subkey == owner.subkey(world_rank) or "[owner:" not in subkey:
                    continue
                forged = held | {"outer_step": FORGED_STEP, "endpoints": [[hosts, server.getsockname()[1]]]}
                later = entry.expiration_time + 3600
                replaced = dht.store(key, subkey=subkey, value=forged, expiration_time=later)
                plain = dht.store(key, subkey=str(world_rank), value=forged, expiration_time=later)
                mine = held | {"outer_step": 0, "step": 0, "settled": False, "done": False,
                               "peers": [dht.peer_id.to_base58()], "endpoints": []}  # fmt: skip
                publish(dht, key, Progress.from_dict(mine), owner.subkey(world_rank))
                print(f"tried to replace group {world_rank}'s record (stored: {replaced}), stored it without an "
                      f"owner (stored: {plain}), claimed world rank {world_rank}", flush=True)  # fmt: skip
            time.sleep(1.0)
    finally:
        server.close()


def malformed(dht, owner: Owner, run: str, run_id: str, world_rank: int, seconds: float) -> None:
    """The ``malformed`` attack (see the module's docstring)."""
    progress = {"world_rank": world_rank, "outer_step": FORGED_STEP, "step": 1, "digest": "f" * 64, "tainted": False,
                "settled": True, "token": uuid.uuid4().hex, "peers": []}  # fmt: skip
    entries = [
        (progress_key(run), progress),
        (progress_key(run), progress | {"outer_step": "x", "peers": [dht.peer_id.to_base58()]}),
        (progress_key(run), progress | {"digest": ["f"], "token": [1, 2], "peers": [dht.peer_id.to_base58()]}),
        (status.status_key(run_id), {"world_rank": world_rank, "ranks": "two", "state": ["training"], "step": None}),
        (tokens_key(run_id), {"world_rank": world_rank, "outer_step": 0, "tokens": "many"}),
    ]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for key, value in entries:  # one at a time: each read of the key sees the last one stored
            dht.store(key, subkey=owner.subkey(world_rank), value=value, expiration_time=time.time() + 60)
            print(f"stored a malformed entry under {key}", flush=True)
            time.sleep(2.0 / len(entries))


def heartbeat(dht, owner: Owner, run_id: str, model: ModelId, world_rank: int, done: threading.Event) -> None:
    """A status record of a one-rank group in training on `model`, refreshed every ``status.HEARTBEAT_S`` until
    `done` (no transport or outer setting: as a trainer from before those fields, which any group accepts)."""
    while not done.is_set():
        record = status.Status(world_rank=world_rank, ranks=1, sharding="FULL_SHARD", state="training", step=0,
                               max_steps=None, outer_step=0, tokens_per_s=None, digest="", round_peers=None,
                               round_at=None, heard_at=time.time(), model=model.fingerprint,
                               parameters=model.parameters, peer=dht.peer_id.to_base58())  # fmt: skip
        try:
            status.publish(dht, status.status_key(run_id), record, owner.subkey(world_rank))
        except Exception:  # the DHT is shutting down
            return
        done.wait(status.HEARTBEAT_S)


def main(attack: str, model_dir: str, run_id: str, galaxy: int, world_rank: int, rounds: int, aggregation: str,
         peers: list[str]) -> None:  # fmt: skip
    module = load_model(Path(model_dir), seed=0)
    model = model_id(module.named_parameters())
    size = model.parameters
    owner = Owner.ephemeral()
    validator = Lenient(owner.validator._private_key) if attack == "claim" else owner.validator
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[], validator=validator)
    if attack in ("forge", "claim", "malformed"):
        try:
            if attack == "malformed":
                return malformed(dht, owner, run_key(run_id, model), run_id, world_rank, rounds)
            return (forge if attack == "forge" else claim)(dht, owner, run_key(run_id, model), world_rank, rounds)
        finally:
            dht.shutdown()
    prefix = f"{run_key(run_id, model)}-groups"  # where the rank 0 of every group of this model matchmakes
    averager = Matchmaker(
        dht, prefix=prefix, matchmaking_time=MATCHMAKING_S, averaging_timeout=AVERAGING_S, target_group_size=galaxy,
    )  # fmt: skip
    listening = listen_socket("127.0.0.1", 0)
    listener = Listener(listening, AVERAGING_S / 4, registration_timeout=AVERAGING_S).start()
    group = GroupRounds(
        averager, rank=0, shape=Shape("FULL_SHARD", 1), model_shapes=[tuple(p.shape) for p in module.parameters()],
        endpoints=[(announced_hosts(dht.get_visible_maddrs()), listening.getsockname()[1])], broadcast=lambda o: o,
        listener=listener, codec=WIRE_FORMATS["none"].tcp, timeout=AVERAGING_S / 4, replicas=None,
        aggregation=aggregation, model=model.fingerprint,
    )  # fmt: skip
    last = torch.zeros(size)  # the swarm's last average, as it came back
    if attack == "frame":
        Round._exchange = huge_frames
    elif attack == "frames":
        Round._exchange = bad_frames
    elif attack == "impostor":
        Round._exchange = impostor
    done = threading.Event()
    threading.Thread(target=heartbeat, args=(dht, owner, run_id, model, world_rank, done), daemon=True).start()
    try:
        rendezvous(dht, f"{prefix}-members", str(world_rank), galaxy, 60)
        for round_index in range(1, rounds + 1):
            if attack == "nan":
                sent = torch.full((size,), float("nan"))
            else:  # flip50's and heavy's forgeries; `frame` sends nothing (zeros count only in its own span)
                sent = {"flip50": -50 * last, "heavy": -last}.get(attack, torch.zeros(size))
            weight = HEAVY if attack == "heavy" else 1.0
            report = group.average([sent], round_index, weight, lambda: False)  # in place: `sent` holds the average
            if report.ok and report.num_peers > 1:
                last = sent
            print(f"round {round_index}: ok={report.ok} num_peers={report.num_peers} {bad_frame[0]}", flush=True)
            if attack == "frames" and report.num_peers > 1:  # the next attack in a round with the swarm
                bad_frame[0] = FRAMES[(FRAMES.index(bad_frame[0]) + 1) % len(FRAMES)]
    finally:
        done.set()
        listener.close()
        averager.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    attack, model, run, galaxy, rank, rounds, aggregation, *initial = sys.argv[1:]
    main(attack, model, run, int(galaxy), int(rank), int(rounds), aggregation, initial)

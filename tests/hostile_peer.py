"""A misbehaving worker group for the fault tests: it joins the swarm like a one-rank group (over TCP: its rank 0
matchmakes for the group) and, in every round, sends

- ``nan``: a pseudo-gradient full of NaN, as a trainer with a broken NaN check would;
- ``flip50``: -50 times the average the swarm sent it in the round before (zeros in the first): a sign-flipped,
  scaled copy of the honest pseudo-gradient, under the norm screen's 100x. It reduces its own spans honestly,
  with the swarm's ``--hv.aggregation`` (a hostile reducer is another attack);
- ``frame``: nothing: to each reducer it sends, past the handshake, a length header claiming 2**40 bytes and
  then waits; its own span it reduces honestly (its contribution there: zeros).

Usage: python -m tests.hostile_peer ATTACK MODEL_DIR RUN_ID GALAXY_SIZE WORLD_RANK ROUNDS AGGREGATION
INITIAL_PEER...
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from diloco.model import load_model
from diloco.swarm.addresses import announced_hosts
from diloco.swarm.averager import SwarmAverager
from diloco.swarm.codecs import WIRE_FORMATS
from diloco.swarm.dht import rendezvous, start_dht
from diloco.swarm.fingerprint import model_id, run_key
from diloco.swarm.group_round import GroupRounds
from diloco.swarm.layout import Shape
from diloco.swarm.listener import Listener, listen_socket
from diloco.swarm.tcp import LENGTH, Round

MATCHMAKING_S = 8  # as the honest groups of the test: long enough under load for all three to gather
AVERAGING_S = 15


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


def main(attack: str, model_dir: str, run_id: str, galaxy: int, world_rank: int, rounds: int, aggregation: str,
         peers: list[str]) -> None:  # fmt: skip
    module = load_model(Path(model_dir), seed=0)
    model = model_id(module.named_parameters())
    size = model.parameters
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[])
    prefix = f"{run_key(run_id, model)}-groups"  # where the rank 0 of every group of this model matchmakes
    averager = SwarmAverager(
        dht, prefix=prefix, tensors=[torch.zeros(1)], matchmaking_time=MATCHMAKING_S, averaging_timeout=AVERAGING_S,
        target_group_size=galaxy, match_only=True,
    )  # fmt: skip
    listening = listen_socket("127.0.0.1", 0)
    listener = Listener(listening, AVERAGING_S / 4, registration_timeout=AVERAGING_S).start()
    group = GroupRounds(
        averager, rank=0, shape=Shape("FULL_SHARD", 1), model_shapes=[tuple(p.shape) for p in module.parameters()],
        endpoints=[(announced_hosts(dht.get_visible_maddrs()), listening.getsockname()[1])], broadcast=lambda o: o,
        listener=listener, codec=WIRE_FORMATS["none"].tcp, timeout=AVERAGING_S / 4, replicas=None,
        aggregation=aggregation,
    )  # fmt: skip
    last = torch.zeros(size)  # the swarm's last average, as it came back
    if attack == "frame":
        Round._exchange = huge_frames
    try:
        rendezvous(dht, f"{prefix}-members", str(world_rank), galaxy, 60)
        for round_index in range(1, rounds + 1):
            if attack == "nan":
                sent = torch.full((size,), float("nan"))
            else:  # flip50's forgery; `frame` sends nothing (zeros count only in its own span)
                sent = -50 * last if attack == "flip50" else torch.zeros(size)
            report = group.average([sent], round_index, 1.0, lambda: False)  # in place: `sent` holds the average
            if report.ok and report.num_peers > 1:
                last = sent
            print(f"round {round_index}: ok={report.ok} num_peers={report.num_peers}", flush=True)
    finally:
        listener.close()
        averager.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    attack, model, run, galaxy, rank, rounds, aggregation, *initial = sys.argv[1:]
    main(attack, model, run, int(galaxy), int(rank), int(rounds), aggregation, initial)

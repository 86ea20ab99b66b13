"""A misbehaving worker group for the fault tests: it joins the swarm like a one-rank group and sends a
pseudo-gradient full of NaN in every round, as a trainer with a broken NaN check would.

Usage: python -m tests.nan_peer MODEL_DIR RUN_ID GALAXY_SIZE WORLD_RANK ROUNDS INITIAL_PEER...
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from diloco.model import load_model
from diloco.swarm.averager import SwarmAverager
from diloco.swarm.dht import rendezvous, start_dht
from diloco.swarm.fingerprint import model_id, run_key

MATCHMAKING_S = 8  # as the honest groups of the test: long enough under load for all three to gather


def main(model_dir: str, run_id: str, galaxy: int, world_rank: int, rounds: int, peers: list[str]) -> None:
    model = model_id(load_model(Path(model_dir), seed=0).named_parameters())
    size = model.parameters
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[])
    prefix = f"{run_key(run_id, model)}-rank0of1"  # where one-rank groups of this model meet
    averager = SwarmAverager(
        dht, prefix=prefix, tensors=[torch.zeros(size)], matchmaking_time=MATCHMAKING_S, averaging_timeout=15,
        target_group_size=galaxy,
    )  # fmt: skip
    try:
        rendezvous(dht, f"{prefix}-members", str(world_rank), galaxy, 60)
        for round_index in range(1, rounds + 1):
            report = averager.average([torch.full((size,), float("nan"))], round_index=round_index)
            print(f"round {round_index}: ok={report.ok} num_peers={report.num_peers}", flush=True)
    finally:
        averager.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    model, run, galaxy, rank, rounds, *initial = sys.argv[1:]
    main(model, run, int(galaxy), int(rank), int(rounds), initial)

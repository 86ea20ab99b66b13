"""A peer of the rank-by-rank averager (``diloco.bench.averager.SwarmAverager``) in its own interpreter, as torchrun
starts trainers: one round per compression on seeded tensors, its results on stdout; and what the tests compare
them with."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys

import torch

from diloco.bench.averager import SwarmAverager
from diloco.swarm.records.dht import start_dht
from tests.support.dht import LOCAL, shutdown_dht

NUM_VALUES = 1_000_000  # per peer, split over two tensors so that multi-tensor bookkeeping is exercised
COMPRESSIONS = ("none", "fp16", "int8")


def peer_tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(999, 1000, generator=generator), torch.randn(NUM_VALUES - 999_000, generator=generator)]


def digest(tensors: list[torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in tensors)).hexdigest()


def errors_vs_mean(tensors: list[torch.Tensor], seeds: list[int]) -> tuple[float, float]:
    """(max abs error, relative RMS error) of ``tensors`` vs the float64 mean of the peers' inputs."""
    inputs = [peer_tensors(seed) for seed in seeds]
    flat = torch.cat([t.flatten() for t in tensors]).double()
    mean = torch.stack([torch.cat([t.flatten() for t in peer]).double() for peer in inputs]).mean(0)
    error = flat - mean
    return error.abs().max().item(), (error.norm() / mean.norm()).item()


def peer_main(index: int, num_peers: int, initial_peers: list[str], transport: str) -> None:
    """A worker group in its own interpreter (like torchrun's): one round per compression, results on stdout."""
    torch.set_num_threads(1)
    dht = start_dht(initial_peers=initial_peers, host_maddrs=LOCAL, announce_maddrs=[])
    try:
        for compression in COMPRESSIONS:
            tensors = peer_tensors(index)
            with SwarmAverager(
                dht,
                prefix=f"test{num_peers}-{transport}/rank0-{compression}",
                tensors=tensors,
                compression=compression,
                matchmaking_time=3.0,
                averaging_timeout=100.0,  # a sender is dropped after 25 s of silence (15 s was once too few under CI load)
                # 2 peers wait the whole matchmaking_time; 3 peers start as soon as everyone joined
                target_group_size=None if num_peers == 2 else num_peers,
                transport=transport,
            ) as averager:
                print("READY", flush=True)
                sys.stdin.readline()  # the test releases all peers at once
                report = averager.average(tensors)
            max_error, relative_rms = errors_vs_mean(tensors, seeds=list(range(num_peers)))
            result = dict(
                report=dataclasses.asdict(report),
                digest=digest(tensors),
                max_error=max_error,
                relative_rms=relative_rms,
                shapes=[list(t.shape) for t in tensors],
            )
            print("RESULT " + json.dumps(result), flush=True)
    finally:
        print("LEFTOVER " + json.dumps(shutdown_dht(dht)), flush=True)

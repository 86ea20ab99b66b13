"""One TCP round (`diloco.swarm.rounds.tcp`) of a group of peers as threads of the test's process, with real listeners
and sockets on loopback, and the seeded vectors they average."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch

from diloco.swarm.rounds import tcp
from diloco.swarm.rounds.layout import RankLayout, Schedule
from diloco.swarm.rounds.listener import Listener, listen_socket
from diloco.swarm.rounds.tcp import RAW, Round, RoundFailed


def run_group(
    vectors: list[torch.Tensor],
    codec: tcp.Codec = RAW,
    weights: list[float] | None = None,
    timeout: float = 5.0,
    endpoints: list[tuple[list[str], int]] | None = None,
    members: list[int] | None = None,
    schedules: list[Schedule] | None = None,
    in_place: bool = False,
    aggregation: str = "mean",
    sealed: bool = False,
    relay: Callable[[int], int] | None = None,
) -> tuple[list[torch.Tensor], list[str | None], list[Round], float]:
    """One round of a group of ``len(vectors)`` peers (only ``members`` take part; the others are silent), with a
    flat schedule unless ``schedules`` are given; `in_place`: each peer's output is its vector; `relay`: the port
    to dial for a listener's port. Returns (outputs, error of each member or None, rounds, seconds)."""
    k = len(vectors)
    members = list(range(k)) if members is None else members
    listeners = [Listener(listen_socket("127.0.0.1", 0), timeout).start() for _ in range(k)]
    ports = [listener._sock.getsockname()[1] for listener in listeners]
    ports = [relay(port) for port in ports] if relay is not None else ports
    endpoints = endpoints or [(["127.0.0.1"], port) for port in ports]
    group_id = os.urandom(32)
    outs = list(vectors) if in_place else [torch.full_like(v, float("nan")) for v in vectors]
    weights = weights or [1.0] * k
    schedules = schedules or [None] * k
    rounds = [
        Round(v, o, group_id=group_id, index=i, endpoints=endpoints, weight=weights[i], codec=codec, timeout=timeout,
              schedule=schedules[i], aggregation=aggregation, sealed=sealed)  # fmt: skip
        for i, (v, o) in enumerate(zip(vectors, outs))
    ]
    errors: list[str | None] = [None] * k

    def member(i: int) -> None:
        try:
            rounds[i].run()
        except RoundFailed as e:
            errors[i] = str(e)

    for i in members:
        listeners[i].register(rounds[i])
    started = time.monotonic()
    threads = [threading.Thread(target=member, args=(i,)) for i in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    seconds = time.monotonic() - started
    assert not any(thread.is_alive() for thread in threads), "a round hangs"
    for listener in listeners:
        listener.close()
    return outs, [errors[i] for i in members], rounds, seconds


def randn(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def canonical(outs: list[torch.Tensor], layout: list[RankLayout], numel: int) -> torch.Tensor:
    """A group's ranks' exchanged values put back in canonical order (NaN where none of them exchanges)."""
    vector = torch.full((numel,), float("nan"))
    for out, rank in zip(outs, layout):
        for p in rank.exchanged:
            vector[p.start : p.stop] = out[p.local : p.local + p.numel]
    return vector

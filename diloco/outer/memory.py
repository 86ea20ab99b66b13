"""An in-memory swarm for worker groups that run as threads of one process: the tests of the outer loop and
`diloco bench convergence`.

The groups of a round meet at a barrier (those behind the others' outer step sit it out, as in the real swarm:
``diloco.swarm.rounds.group_round.abreast``) and each gets the exact weighted mean of their tensors, summed in one
order (by peer id), which is what the real swarm computes with `--hv.compression none`: bit-identical in every
group. Given a wire format's codec (`diloco.swarm.rounds.tcp.Codec`), every contribution and the mean go through it,
part by part, as over the wire (a real reducer's own part skips it: this is slightly the more lossy). With a robust
``aggregation`` the groups' tensors are laid end to end and combined part by part (``PART_NUMEL`` values, as the TCP
transport cuts a flat vector) by ``diloco.swarm.rounds.aggregation``. Progress and status records and served states live
in dicts. It implements `diloco.outer.links.Swarm`; plain torch, no hivemind, no network.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from diloco.config import Aggregation
from diloco.swarm.records.budget import RoundTokens
from diloco.swarm.records.progress import Progress
from diloco.swarm.records.status import Status
from diloco.swarm.rounds.aggregation import aggregate
from diloco.swarm.rounds.group_round import abreast
from diloco.swarm.rounds.screening import capped_weights
from diloco.swarm.rounds.tcp import RAW
from diloco.swarm.rounds.transfer import Frozen, Served

State = tuple[dict[str, Any], list[torch.Tensor]]
PART_NUMEL = RAW.part_numel  # values per part of a robust aggregation: as the TCP transport cuts them


@dataclass
class Report:
    """One round's outcome, as `diloco.swarm.rounds.report.RoundReport` gives it."""

    num_peers: int
    ok: bool = True
    seconds: float = 0.0
    allreduce_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    rejected: int = 0
    transport: str = ""
    round_id: str = ""
    dropped: int = 0
    behind: bool = False
    bytes_inbound: int = 0
    bytes_relayed: int = 0


class MemorySwarm:
    """The shared side: who averages, what they sent, the published records and the state providers.

    :param groups: worker groups that take part in every round (the barrier's size; replace `barrier` with a
        bigger one when a group joins).
    :param codec: what the contributions and the mean go through (None: exact float32); `wire_bytes` counts the
        encoded bytes of every contribution.
    :param aggregation: how the contributions are combined (``--hv.aggregation``).
    """

    def __init__(self, groups: int, codec: Any = None, aggregation: Aggregation = "mean") -> None:
        self.codec, self.aggregation = codec, aggregation
        self.wire_bytes = 0
        self._count_lock = threading.Lock()
        self.barrier = threading.Barrier(groups)
        self.inbox: dict[str, tuple[list[torch.Tensor], float, int | None]] = {}  # (tensors, weight, outer step)
        self.records: dict[tuple[str, int], Progress] = {}  # by (owner, world rank): only its owner replaces one
        self.statuses: dict[int, Status] = {}
        self.tokens: dict[int, RoundTokens] = {}
        self.providers: dict[str, Callable[[], Served]] = {}
        self.failed: list[str] = []  # errors of group threads (see `guard`)

    def wire(self, tensor: torch.Tensor, count: bool = False) -> torch.Tensor:
        """`tensor` as it arrives through the codec (a copy; itself when there is no codec, as a clone)."""
        if self.codec is None:
            return tensor.clone()
        flat, out = tensor.reshape(-1), torch.empty(tensor.numel())
        chunks, n = self.codec.chunks, flat.numel()
        runs = chunks.runs(0, n, self.codec.part_numel) if chunks is not None else [
            (lo, min(lo + self.codec.part_numel, n)) for lo in range(0, n, self.codec.part_numel)]  # fmt: skip
        for lo, hi in runs:
            part = flat[lo:hi].contiguous()
            encoded = bytearray(memoryview(self.codec.encode_part(part, lo)).cast("B"))
            if count:
                with self._count_lock:
                    self.wire_bytes += len(encoded)
            out[lo:hi] = self.codec.decode_part(memoryview(encoded), hi - lo, lo)
        return out.view(tensor.shape)

    def image(self, values: torch.Tensor) -> torch.Tensor:
        """What a round carries of a group's `values` (the whole model's vector)."""
        return values if self.codec is None or self.codec.chunks is None else self.wire(values)

    def combine(self, inputs: list[tuple[list[torch.Tensor], float]]) -> list[torch.Tensor]:
        """The groups' (tensors, weight) combined, tensor by tensor, as every group receives them; weights capped
        as the transport caps the announced ones (``capped_weights``)."""
        weights = capped_weights([w for _, w in inputs])
        inputs = [(ts, w) for (ts, _), w in zip(inputs, weights)]
        if self.aggregation == "mean":
            total = sum(weights)
            means = [sum(ts[i] * w for ts, w in inputs) / total for i in range(len(inputs[0][0]))]
            relayed = self.codec is not None and self.codec.relay is not None  # the contributions, as sent
            return means if relayed else [self.wire(mean) for mean in means]
        flats = [torch.cat([t.reshape(-1) for t in ts]) for ts, _ in inputs]
        flat = torch.cat([aggregate([f[lo : lo + PART_NUMEL] for f in flats], weights, self.aggregation)
                          for lo in range(0, flats[0].numel(), PART_NUMEL)])  # fmt: skip
        shapes = [t.shape for t in inputs[0][0]]
        return [self.wire(part.view(shape)) for part, shape in zip(flat.split([s.numel() for s in shapes]), shapes)]

    def member(self, peer_id: str, owner: str | None = None) -> Member:
        """A group's link; its records are signed by `owner` (default: `peer_id`)."""
        return Member(self, peer_id, owner)

    def guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        """`fn` for a group's thread: an error is recorded in `failed` and the barrier broken, so the other
        groups stop too instead of waiting for this one forever."""

        def target() -> None:
            try:
                fn()
            except threading.BrokenBarrierError:
                pass
            except Exception as e:  # noqa: BLE001 - reported through `failed`
                self.failed.append(f"{type(e).__name__}: {e}")
                self.barrier.abort()

        return target

    def run_groups(self, group: Callable[[int], None], count: int, name: str) -> None:
        """`group(g)` for g in range(`count`), each in a thread of its own named `<name>-g<g>` and `guard`ed; returns
        once every one ended (their errors are in `failed`)."""
        threads = [threading.Thread(target=self.guard(functools.partial(group, g)), name=f"{name}-g{g}")
                   for g in range(count)]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


class Member:
    """One group's link to the swarm (`diloco.outer.links.Swarm`)."""

    def __init__(self, swarm: MemorySwarm, peer_id: str, owner: str | None = None) -> None:
        self.swarm, self.peer_id = swarm, peer_id
        self.owner = peer_id if owner is None else owner  # who signs this member's records
        self.reach = ""  # (in one process: nobody dials anyone)

    def average(
        self,
        tensors: Sequence[torch.Tensor],
        round_index: int,
        weight: float,
        stop: Callable[[], bool],
        fragment: int | None = None,
        outer_step: int | None = None,
        last: bool = False,
    ) -> Report:
        swarm = self.swarm
        swarm.inbox[self.peer_id] = ([swarm.wire(t, count=True) for t in tensors], weight, outer_step)
        swarm.barrier.wait()
        names = sorted(swarm.inbox)  # one summation order: the same bytes
        kept = [names[i] for i in abreast([swarm.inbox[name][2] for name in names], round_index)]
        inputs = [swarm.inbox[name][:2] for name in kept]
        behind = self.peer_id not in kept  # it sits the round out, its tensors as they were
        means = [] if behind else swarm.combine(inputs)
        swarm.barrier.wait()  # everyone has read the inbox before the next round overwrites it
        if behind:
            return Report(num_peers=len(names), ok=False, behind=True)
        for tensor, mean in zip(tensors, means):
            tensor.copy_(mean)
        return Report(num_peers=len(inputs), round_id=f"r{round_index}" if len(inputs) > 1 else "")

    def image(self, values: torch.Tensor, fragment: int | None = None) -> torch.Tensor:
        if fragment is not None and self.swarm.codec is not None and self.swarm.codec.chunks is not None:
            raise NotImplementedError("the in-memory swarm's sparse rounds are of the whole model")
        return self.swarm.image(values)

    def publish(self, record: Progress) -> None:
        self.swarm.records[self.owner, record.world_rank] = replace(record, owner=self.owner)

    def records(self) -> list[Progress]:
        return list(self.swarm.records.values())

    def publish_status(self, record: Status) -> None:
        self.swarm.statuses[record.world_rank] = record

    def status_records(self) -> list[Status]:
        return list(self.swarm.statuses.values())

    def publish_tokens(self, record: RoundTokens) -> None:
        self.swarm.tokens[record.world_rank] = record

    def token_records(self) -> list[RoundTokens]:
        return list(self.swarm.tokens.values())

    def alive(self, peer_id: str) -> bool:
        return peer_id in self.swarm.providers

    rejected_records = 0  # no swarm key in memory
    rejected_states = 0  # states are handed over in memory, never refused
    refused_connections = 0  # no sockets

    def serve_state(self, provider: Callable[[], Served]) -> None:
        self.swarm.providers[self.peer_id] = provider

    def download_state(self, record: Progress, rank: int,
                       wanted: Callable[[dict[str, Any]], bool] | None = None) -> State | None:  # fmt: skip
        provider = self.swarm.providers.get(record.peers[rank]) if rank < len(record.peers) else None
        if provider is None:
            return None
        meta, tensors = provider()
        if wanted is not None and not wanted(meta):
            return meta, []
        return meta, Frozen.of(tensors).whole()

    def shutdown(self) -> None:
        self.swarm.providers.pop(self.peer_id, None)

"""A group's beacon: the status record it sends for onlookers (``diloco status``) and for the other groups' checks of
what a run must share (``diloco.outer.agreement``).

Rank 0 sends it when the group joins, after every outer step, as a heartbeat at most every ``HEARTBEAT_S`` while it
trains (``DiLoCo.progress``), and when it leaves. Sending never waits for the network, so neither does an inner step.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from diloco.outer.links import Swarm
from diloco.swarm.records.fingerprint import ModelId
from diloco.swarm.records.status import DIGEST_CHARS, HEARTBEAT_S, Status

RATE_ROWS = 5  # metrics rows whose median throughput a record carries
WIRE = "wire:"  # the outer setting's word that names the wire format (``outer_setting``)


@dataclass
class Beacon:
    """What a group says of itself that does not change over a run, and what it last measured.

    :param outer: the outer setting, ``lr/momentum wN`` plus a robust aggregation's name and the wire format
        (``outer_setting``).
    :param schedule: when rounds are due and the last inner step (``agreement.schedule``).
    :param max_steps: the run's last inner step; None: none.
    :param peer: the peer id of the group's rank 0.
    :param batch: its inner step, ``<total batch size>x<sequence length>``.
    """

    swarm: Swarm
    is_main: bool
    world_rank: int
    ranks: int
    sharding: str
    transport: str
    outer: str
    schedule: str
    max_steps: int | None
    model: ModelId | None
    peer: str
    batch: str = ""
    reach: str = ""  # whether others can dial its rank 0 (``Swarm.reach``)
    tokens_per_s: float | None = None  # of the group: the median of the training loop's last metrics rows
    rates: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_ROWS))
    last_round: tuple[int, float] | None = None  # (num_peers, wall-clock end) of the last round
    discarded_steps: int = 0  # inner steps this group threw away so far (``DiLoCo._discard``)
    paused_until: float | None = None  # wall-clock end of the pause under way (``DiLoCo.pause``)
    sent_at: float = -math.inf  # monotonic time of the last record

    def measured(self, tokens_per_s: float) -> None:
        """A metrics row's throughput. The record carries the median of the last ``RATE_ROWS``: the row after a
        round, an evaluation or a checkpoint counts their time too, and the others' arrival estimates use it."""
        self.rates.append(tokens_per_s)
        self.tokens_per_s = statistics.median(self.rates)

    @property
    def sent(self) -> bool:
        return self.sent_at > -math.inf

    def heartbeat_due(self) -> bool:
        return time.monotonic() - self.sent_at >= HEARTBEAT_S

    def send(self, state: str, step: int, outer_step: int, digest: str) -> Status | None:
        """Rank 0: send the record of a group in `state` at (its schedule's) inner step `step`; returns it (None on
        the other ranks)."""
        record = self.record(state, step, outer_step, digest)
        if record is not None:
            self.sent_at = time.monotonic()
            self.swarm.publish_status(record)
        return record

    def record(self, state: str, step: int, outer_step: int, digest: str) -> Status | None:
        """Rank 0: the record `send` sends (None on the other ranks)."""
        if not self.is_main:
            return None
        round_peers, round_at = self.last_round or (None, None)
        return Status(
            world_rank=self.world_rank,
            ranks=self.ranks,
            sharding=self.sharding,
            transport=self.transport,
            outer=self.outer,
            schedule=self.schedule,
            state=state,
            step=step,
            max_steps=self.max_steps,
            outer_step=outer_step,
            tokens_per_s=self.tokens_per_s,
            digest=digest[:DIGEST_CHARS],
            round_peers=round_peers,
            round_at=round_at,
            heard_at=time.time(),
            model=self.model.fingerprint if self.model else "",
            parameters=self.model.parameters if self.model else None,
            peer=self.peer,
            batch=self.batch,
            discarded_steps=self.discarded_steps,
            paused_until=self.paused_until,
            reach=self.reach,
        )


def outer_setting(lr: float, momentum: float, warmup: int, aggregation: str, wire: str = "") -> str:
    """The outer setting as a status record carries it; the mean is left out, as records from before
    ``--hv.aggregation`` have it. `wire`: the round's wire format (``agreement.wire_format``; "": not said, as
    records from before it)."""
    robust = "" if aggregation == "mean" else f" {aggregation}"
    return f"{lr:g}/{momentum:g} w{warmup}{robust}" + (f" {WIRE}{wire}" if wire else "")


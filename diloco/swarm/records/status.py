"""Status records: what each worker group tells onlookers (``diloco status``) about itself, under which key.

Separate from the progress record (``diloco.swarm.records.progress``), which groups read to decide whose state to load:
older trainers build that one with ``Progress(**data)`` and drop a record with fields they do not know, so what
only a person watching the run needs (ranks, sharding, throughput, the last round, a heartbeat) lives here. Rank 0
of a group publishes it at start, after every outer step, and as a heartbeat (at most every ``HEARTBEAT_S``) while
it trains; a record expires ``STATUS_TTL`` seconds after its last refresh, so a dead group drops out of the table
after a while and shows how long ago it was last heard until then. A record is a few hundred bytes.

Plain Python: the DHT is any object with hivemind's ``store`` / ``get`` (``progress.Store``), so importing this
costs no hivemind.
"""

from __future__ import annotations

import time
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from diloco.swarm.records.ownership import Refused, owned_records
from diloco.swarm.records.progress import Store

STATUS_TTL = 180.0  # seconds a status record lives without a refresh: a dead group leaves the table after this
HEARTBEAT_S = 5.0  # least seconds between two heartbeats of a training group (outer steps publish at once)
DIGEST_CHARS = 16  # hex characters of the outer digest a record carries (onlookers compare groups by it)
LEFT = ("finished", "stopped", "failed")  # the states of a group that left the run
NO_MORE_ROUNDS = ("done", *LEFT)  # a group that took its last round: no round waits for it or counts it


@dataclass(frozen=True)
class Status:
    """One worker group's state as onlookers see it.

    :param world_rank: the group's world rank.
    :param ranks: ranks (processes) in the group.
    :param sharding: its FSDP sharding strategy (``FULL_SHARD``, ...).
    :param state: ``joining``, ``training``, ``done`` (last inner step taken, settling with the others), then
        ``finished``, ``stopped`` (by a signal) or ``failed`` once it left.
    :param step: inner steps done.
    :param max_steps: the run's last inner step; None when unbounded.
    :param outer_step: outer steps applied.
    :param tokens_per_s: inner-step throughput of the whole group (the last metrics row); None before the first.
    :param digest: the first ``DIGEST_CHARS`` hex characters of the outer digest (equal: the same outer state).
    :param round_peers: worker groups in its last round, itself included: 0 the round failed, 1 it averaged alone;
        None before its first round.
    :param round_at: wall-clock time (s since the epoch) its last round ended; None before the first.
    :param heard_at: wall-clock time the record was written, by the group's clock.
    :param model: the fingerprint of the group's model (``diloco.swarm.records.fingerprint``); empty from trainers
        before fingerprints, like the next two.
    :param parameters: the model's parameter count.
    :param peer: the peer id of the group's rank 0.
    :param transport: its ``--hv.transport``; empty from trainers before groups of any shape.
    :param outer: its outer SGD setting, ``lr/momentum wN`` (``DiLoCo.outer_setting``); empty from earlier trainers.
    :param schedule: when it takes outer steps and its last inner step (``diloco.outer.agreement.schedule``), e.g.
        ``200 steps, H 25``; empty from earlier trainers.
    :param batch: its inner step, ``<--total-batch-size>x<--seq-length>`` (e.g. ``16x128``); empty from earlier
        trainers.
    :param discarded_steps: inner steps this group discarded so far (loaded over by another group's state, or a last
        round that applied nothing); 0 from earlier trainers.
    :param paused_until: wall-clock time until which the group expects to be away from its inner steps (a checkpoint
        or an evaluation under way, expected to take as long as its last one); None: not away, or no estimate.
    :param reach: whether others can dial its rank 0 (``diloco.swarm.rounds.reachability``): ``direct``,
        ``outbound only`` (behind a router: it dials out only), ``unchecked``; empty from earlier trainers.
    """

    world_rank: int
    ranks: int
    sharding: str
    state: str
    step: int
    max_steps: int | None
    outer_step: int
    tokens_per_s: float | None
    digest: str
    round_peers: int | None
    round_at: float | None
    heard_at: float
    model: str = ""
    parameters: int | None = None
    peer: str = ""
    transport: str = ""
    outer: str = ""
    schedule: str = ""
    batch: str = ""
    discarded_steps: int = 0
    paused_until: float | None = None
    reach: str = ""

    @property
    def round(self) -> str | None:
        """The last round's outcome: ``ok`` (averaged with others), ``alone``, ``failed``; None before the first."""
        if self.round_peers is None:
            return None
        return "failed" if self.round_peers == 0 else "alone" if self.round_peers == 1 else "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Status | None:
        """A record read back from the DHT; None when it is not one (another version, garbage). Unknown fields
        are ignored, so a later version may add some; fields with a default may be missing (an earlier version)."""
        if not isinstance(data, dict):
            return None
        try:
            record = cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data or f.default is MISSING})
        except (TypeError, KeyError):
            return None
        return record if _well_typed(record) else None


def _well_typed(record: Status) -> bool:
    """Whether the values have the types the table formats (a peer may run anything)."""
    ints = (record.world_rank, record.ranks, record.step, record.outer_step)
    optional_numbers = (record.max_steps, record.tokens_per_s, record.round_peers, record.round_at,
                        record.paused_until)  # fmt: skip
    return (
        all(isinstance(v, int) for v in ints)
        and all(v is None or isinstance(v, (int, float)) for v in optional_numbers)
        and isinstance(record.heard_at, (int, float))
        and all(isinstance(v, str) for v in (record.sharding, record.state, record.digest, record.model, record.peer,
                                             record.transport, record.outer, record.schedule,
                                             record.batch, record.reach))  # fmt: skip
        and (record.parameters is None or isinstance(record.parameters, int))
        and _count(record.discarded_steps)
    )


def _count(value: Any) -> bool:
    """A count of things: an int (not a bool) >= 0."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ---------------------------------------------------------------- in the DHT


def status_key(run_id: str) -> str:
    """The DHT key of a run's status records (one per group, every group shape under one key)."""
    return f"{run_id}-status"


def publish(dht: Store, key: str, record: Status, subkey: str, **kwargs: Any) -> Any:
    """Store `record` under `key` and the group's own `subkey` (``Owner.subkey``); `kwargs` go to ``store``
    (``return_future``)."""
    # hivemind's DHT time is the wall clock (hivemind.utils.timed_storage.get_dht_time = time.time)
    expires = time.time() + STATUS_TTL
    return dht.store(key, subkey=subkey, value=record.to_dict(), expiration_time=expires, **kwargs)


def read(dht: Store, key: str, refused: Refused | None = None) -> list[Status]:
    """Every group's latest record under `key`, by world rank (``ownership.owned_records``: entries that are not
    records are skipped, and `refused` is told of them)."""
    found = owned_records(dht.get(key, latest=True), Status.from_dict, refused)
    return sorted((record for _, record in found), key=lambda r: r.world_rank)

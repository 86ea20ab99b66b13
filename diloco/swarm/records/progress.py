"""Progress records: what each worker group publishes in the DHT about its outer state, and under which key.

Every group publishes one record (its rank 0 does, at start and after each outer step) under one DHT key per run,
whatever its shape, under a subkey naming its world rank and its own key (``diloco.swarm.records.ownership``: nobody
else can change it). Which group holds the swarm's state, by these records, is the outer loop's to decide
(``diloco.outer.catchup``).

Plain Python: the DHT is any object with hivemind's `store` / `get`, so importing this costs no hivemind.
"""

from __future__ import annotations

import time
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any, Protocol

from diloco.swarm.records.ownership import Refused, owned_records

PROGRESS_TTL = 24 * 3600.0  # seconds a group's progress record lives without a refresh (it refreshes every round)


@dataclass(frozen=True)
class Progress:
    """One worker group's published progress.

    :param world_rank: the group's world rank.
    :param outer_step: outer steps applied to its outer parameters.
    :param step: inner steps done when the record was written.
    :param digest: the digest of its outer state, parameters and momentum, over all its ranks
        (``diloco.swarm.rounds.digest``; equal digests: identical states).
    :param tainted: its last outer step was not a full average (it averaged alone, the round failed, or its
        ranks averaged with different peers).
    :param settled: it has joined the swarm (loaded the state or found it was the first), so others may
        download from it.
    :param token: random per start of a group; two different tokens for one world rank are two groups.
    :param peers: peer id of each rank's DHT peer, in rank order (rank 0's answers pings: is the group alive).
    :param done: it took its last inner step and waits for the others to hold the same final state.
    :param shape: its ``[strategy, ranks, nodes]``, and `endpoints` each rank's listener (``[hosts, port]``, over
        p2pd ``[[peer id], 0]``), in rank order: a group of any shape downloads from them. Empty in records of the
        in-memory swarm.
    :param owner: who signed the record (``ownership.owner_id``), from its subkey; not part of the value.
    """

    world_rank: int
    outer_step: int
    step: int
    digest: str
    tainted: bool
    settled: bool
    token: str
    peers: tuple[str, ...]
    done: bool = False
    shape: tuple = ()
    endpoints: tuple = ()
    owner: str = field(default="", compare=False)

    @property
    def state(self) -> tuple[int, str]:
        return self.outer_step, self.digest

    @property
    def serves(self) -> bool:
        """Whether others may download its state: a group that cannot be dialled (outbound only) names its shape and
        no endpoints; records of the in-memory swarm name neither."""
        return not self.shape or bool(self.endpoints)

    def to_dict(self) -> dict[str, Any]:
        lists = {"peers": list(self.peers), "shape": list(self.shape), "endpoints": list(self.endpoints)}
        return {key: value for key, value in asdict(self).items() if key != "owner"} | lists

    @classmethod
    def from_dict(cls, data: Any) -> Progress | None:
        """A record read back from the DHT; None when it is not one (another version, garbage, a stranger's
        malformed one): every field of its type and in its range, at least one peer id, nothing else."""
        if not isinstance(data, dict) or not REQUIRED <= set(data) <= FIELDS:
            return None
        ints = all(_count(data[name]) for name in ("world_rank", "outer_step", "step"))
        flags = all(isinstance(data.get(name, False), bool) for name in ("tainted", "settled", "done"))
        texts = all(_text(data[name]) for name in ("digest", "token"))
        peers = data["peers"]
        peers_ok = isinstance(peers, (list, tuple)) and 0 < len(peers) <= MAX_PEERS and all(map(_text, peers))
        lists = all(isinstance(data.get(name, ()), (list, tuple)) for name in ("shape", "endpoints"))
        if not (ints and flags and texts and peers_ok and lists):
            return None
        tuples = {name: tuple(data.get(name, ())) for name in ("peers", "shape", "endpoints")}
        return cls(**{**data, **tuples})


FIELDS = {f.name for f in fields(Progress)} - {"owner"}  # what a record holds: a value with any other key is refused
REQUIRED = {f.name for f in fields(Progress) if f.default is MISSING}
MAX_TEXT = 256  # characters of a digest, a token or a peer id (a sha256 is 64, a peer id about 50)
MAX_PEERS = 2**16  # ranks of a group


def _count(value: Any) -> bool:
    """A whole number >= 0 that is not a bool (JSON and msgpack keep the two apart; Python's bool is an int)."""
    return type(value) is int and 0 <= value < 2**63


def _text(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= MAX_TEXT


# ---------------------------------------------------------------- in the DHT


class Store(Protocol):
    """The part of ``hivemind.DHT`` the records need."""

    def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None) -> Any: ...

    def get(self, key: str, latest: bool = False) -> Any: ...


def progress_key(run_id: str) -> str:
    """The DHT key of a run's records, shared by groups of every shape."""
    return f"{run_id}-groups-progress"


def publish(dht: Store, key: str, record: Progress, subkey: str, **kwargs: Any) -> Any:
    """Store `record` under `key` and `subkey` (``Owner.subkey``: the group's own); `kwargs` go to ``store``
    (``return_future``). Of two stores the later expiry wins, so records stored in the background keep their
    order."""
    # hivemind's DHT time is the wall clock (hivemind.utils.timed_storage.get_dht_time = time.time)
    expires = time.time() + PROGRESS_TTL
    return dht.store(key, subkey=subkey, value=record.to_dict(), expiration_time=expires, **kwargs)


def read(dht: Store, key: str, refused: Refused | None = None) -> list[Progress]:
    """Every group's latest record under `key`, with its owner (``ownership.owned_records``: entries that are not
    records are skipped, and `refused` is told of them)."""
    return [replace(record, owner=owner) for owner, record in owned_records(dht.get(key, latest=True),
                                                                            Progress.from_dict, refused)]  # fmt: skip

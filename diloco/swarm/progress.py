"""Progress records: what each worker group publishes in the DHT, under which key, and which group holds the
swarm's state.

Every group publishes one record (its rank 0 does, at start and after each outer step) under one DHT key per run,
whatever its shape, under a subkey naming its world rank and its own key (``diloco.swarm.ownership``: nobody else
can change it). A group compares its own record with the live ones of the
others (`sources`): the swarm's state is the one with the highest outer step; between groups at the same outer
step, a state that came out of a full average beats one that did not (a lone or failed round), then the state more
groups hold, then the lowest world rank. This order is the same for everyone, so groups that diverged (a round that
succeeded for some and failed for others, or two halves of a split swarm) converge again on one state. A state whose
downloads this group refused too often is skipped (`Refused`). In a round, the groups behind the others sit it out
(`abreast`).

Plain Python: the DHT is any object with hivemind's `store` / `get`, so importing this costs no hivemind.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from diloco.swarm.ownership import owned_entries

PROGRESS_TTL = 24 * 3600.0  # seconds a group's progress record lives without a refresh (it refreshes every round)
REFUSALS_BEFORE_SKIP = 3  # refused answers for one state of one group before a running group stops asking for it


@dataclass(frozen=True)
class Progress:
    """One worker group's published progress.

    :param world_rank: the group's world rank.
    :param outer_step: outer steps applied to its outer parameters.
    :param step: inner steps done when the record was written.
    :param digest: sha256 over the outer parameters of all its ranks (equal digests: identical states).
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

    def to_dict(self) -> dict[str, Any]:
        lists = {"peers": list(self.peers), "shape": list(self.shape), "endpoints": list(self.endpoints)}
        return {key: value for key, value in asdict(self).items() if key != "owner"} | lists

    @classmethod
    def from_dict(cls, data: Any) -> Progress | None:
        """A record read back from the DHT; None when it is not one (another version, garbage)."""
        try:
            lists = {key: tuple(data.get(key, ())) for key in ("shape", "endpoints")}
            record = cls(**{**data, **lists, "peers": tuple(data["peers"])})
        except (TypeError, KeyError, AttributeError):
            return None
        return record if all(isinstance(p, str) for p in record.peers) else None


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


def read(dht: Store, key: str) -> list[Progress]:
    """Every group's latest record under `key`, with its owner (entries that are not records, have no owner, or
    claim another world rank than their subkey are skipped)."""
    records = []
    for owner, world_rank, value in owned_entries(dht.get(key, latest=True)):
        record = Progress.from_dict(value)
        if record is not None and record.world_rank == world_rank:
            records.append(replace(record, owner=owner))
    return records


# ---------------------------------------------------------------- who holds the swarm's state


def sources(records: Iterable[Progress], mine: Progress, alive: Callable[[Progress], bool]) -> list[list[Progress]]:
    """States that rank above this group's, best first, each as the live records holding it (lowest world
    rank first). Empty when this group holds the swarm's state (or a state as good).

    :param records: every group's record, this group's own included or not.
    :param mine: this group's record.
    :param alive: whether a record's group answers; asked only for records that could be a source.
    """
    others = [r for r in records if r.world_rank != mine.world_rank and r.settled]
    live = [r for r in others if r.outer_step >= mine.outer_step and r.state != mine.state and alive(r)]
    holders: dict[tuple[int, str], list[Progress]] = defaultdict(list)
    for record in [mine] + [r for r in others if r.state == mine.state] + live:
        holders[record.state].append(record)

    def rank(state: tuple[int, str]) -> tuple[int, bool, int, int]:
        group = holders[state]
        return state[0], any(not r.tainted for r in group), len(group), -min(r.world_rank for r in group)

    ranked = sorted(holders, key=rank, reverse=True)
    return [sorted(holders[s], key=lambda r: r.world_rank) for s in ranked[: ranked.index(mine.state)]]


def abreast(claims: list[object], round_index: int) -> list[int]:
    """The members of round `round_index` that average, by the outer step each announced in matchmaking (None: a
    version from before the field): those at the highest outer step announced, and those that announced none. A
    group behind (its last round failed, and its read of the others' records lagged, so it could not tell) would mix
    a pseudo-gradient of older parameters into the others' round and leave it on another model than theirs: every
    member computes the same list from the same announcements, and the group behind sits the round out (it loads
    their state at its next boundary). No group holds round `round_index`'s outer step or a later one before the
    round: such a claim counts as none, so a stranger cannot send the others out by claiming a huge one."""
    steps = [c if type(c) is int and 0 <= c < round_index else None for c in claims]
    top = max((s for s in steps if s is not None), default=None)
    return [i for i, s in enumerate(steps) if s is None or s == top]


class Refused:
    """The states whose downloads this group refused (an answer came, but short, malformed, unproven or not a state
    of this model), per start of a group (its token) and state. After `limit` refusals a group no longer asks for
    that state (joining, at its boundaries, at the end of the run) nor waits for its holder at the end: a stranger's
    forged record costs it `limit` downloads, not one per round, and cannot keep a swarm's first group from
    starting. A group that moves on to another state is asked again, and an honest answer cut short (a timeout
    under load) has `limit` tries."""

    def __init__(self, limit: int = REFUSALS_BEFORE_SKIP) -> None:
        self.limit = limit
        self._counts: Counter[tuple[str, tuple[int, str]]] = Counter()

    def note(self, record: Progress) -> None:
        self._counts[record.token, record.state] += 1

    def skipped(self, record: Progress) -> bool:
        return self._counts[record.token, record.state] >= self.limit

    def prune(self, plan: list[list[Progress]]) -> list[list[Progress]]:
        """`plan` (see `sources`) without the skipped records (and the states no record is left for)."""
        return [kept for holders in plan if (kept := [r for r in holders if not self.skipped(r)])]

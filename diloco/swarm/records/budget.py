"""Round-token records: how far each worker group is into the current round, for the swarm-wide token budget
(``--hv.target-tokens``).

Each group's rank 0 publishes one small record about once a second while it trains (its tokens since the last
outer step and its rate), under one DHT key per run and a subkey of its world rank and its own key
(``diloco.swarm.records.ownership``). Every group estimates the swarm's tokens in the round from them (`swarm_tokens`):
the records are seconds old, so each is extrapolated by its group's rate, as hivemind's progress tracker does. Groups
read the same records, so they reach the target at about the same moment and meet in one round. A record expires
``TOKENS_TTL`` seconds after its last refresh: a group that died stops counting then.

Plain Python: the DHT is any object with hivemind's ``store`` / ``get`` (``progress.Store``), so importing this
costs no hivemind.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from diloco.swarm.records.ownership import Refused, owned_records
from diloco.swarm.records.progress import Store

TOKENS_TTL = 60.0  # seconds a record lives without a refresh
HORIZON_S = 30.0  # a record is extrapolated at most this far: a group gone silent stops adding tokens


@dataclass(frozen=True)
class RoundTokens:
    """One worker group's progress in the current round.

    :param world_rank: the group's world rank.
    :param outer_step: outer steps applied to its outer parameters; it trains for the round after this one.
    :param tokens: tokens it trained since that outer step, when the record was written.
    :param tokens_per_s: its recent rate, to extrapolate `tokens` to now.
    :param at: wall-clock time (``time.time()``) of `tokens`.
    :param closed: it stopped training for this round and waits for the others in matchmaking (no
        extrapolation: its tokens stay what they are).
    """

    world_rank: int
    outer_step: int
    tokens: int
    tokens_per_s: float
    at: float
    closed: bool = False

    def now(self, now: float) -> float:
        """Its tokens extrapolated to wall-clock time `now`."""
        if self.closed:
            return float(self.tokens)
        return self.tokens + self.tokens_per_s * min(max(now - self.at, 0.0), HORIZON_S)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> RoundTokens | None:
        """A record read back from the DHT; None when it is not one."""
        try:
            record = cls(**data)
        except TypeError:
            return None
        numbers = (record.tokens, record.tokens_per_s, record.at)
        ints = isinstance(record.world_rank, int) and isinstance(record.outer_step, int)
        ints = ints and isinstance(record.closed, bool)
        finite = all(isinstance(n, (int, float)) and math.isfinite(n) and n >= 0 for n in numbers)
        return record if ints and finite else None


def tokens_key(run_id: str) -> str:
    return f"{run_id}-tokens"


def publish(dht: Store, key: str, record: RoundTokens, subkey: str, **kwargs: Any) -> Any:
    """Store `record` under `key` and the group's own `subkey` (``Owner.subkey``); `kwargs` go to ``store``
    (``return_future``)."""
    expires = time.time() + TOKENS_TTL
    return dht.store(key, subkey=subkey, value=record.to_dict(), expiration_time=expires, **kwargs)


def parse(found: Any, refused: Refused | None = None) -> list[RoundTokens]:
    """The records of a ``get(key, latest=True)`` answer (``ownership.owned_records``: entries that are not records
    are skipped, and `refused` is told of them)."""
    return [record for _, record in owned_records(found, RoundTokens.from_dict, refused)]


def swarm_tokens(records: Iterable[RoundTokens], mine: RoundTokens, now: float) -> float:
    """The swarm's tokens in this group's round at `now`: its own, exact, plus every other group's training for
    the same round, extrapolated."""
    others = (r for r in records if r.world_rank != mine.world_rank and r.outer_step == mine.outer_step)
    return mine.tokens + sum(r.now(now) for r in others)


def ahead(records: Iterable[RoundTokens], mine: RoundTokens) -> bool:
    """Whether another group already took the outer step this group trains for (it is behind: go to the round,
    which loads the swarm's state)."""
    return any(r.outer_step > mine.outer_step and r.world_rank != mine.world_rank for r in records)

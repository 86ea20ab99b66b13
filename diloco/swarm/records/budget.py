"""Round-token records: how far each worker group is into the current round, for the swarm-wide token budget
(``--hv.target-tokens``).

Each group's rank 0 publishes one small record about once a second while it trains (its tokens since the last
outer step and its rate), under one DHT key per run and a subkey of its world rank and its own key
(``diloco.swarm.records.ownership``). Every group estimates the swarm's tokens in the round from them (`swarm_tokens`):
the records are seconds old, so each is extrapolated by its group's rate, as hivemind's progress tracker does. Groups
read the same records, so they reach the target at about the same moment and meet in one round. A record also
carries its group's step time and is written at the end of a step, so the others know when the step under way ends
(`step_ends`): a faster group trains on until a slower one comes (``diloco.outer.pace``). A record expires
``TOKENS_TTL`` seconds after its last refresh: a group that died stops counting then.

In an open swarm anyone can store records under the run's key, with world ranks of their choosing, so the
estimate trusts none of them far: only world ranks of the galaxy count (``0 .. galaxy size - 1``, this group's
excepted), one record each (the largest, should a stranger sign one beside the group's own), and each adds at
most ``OTHERS_CAP`` times this group's own tokens in the round. A stranger can still pose as groups that are
``OTHERS_CAP`` times as fast as this one in every other world rank of the galaxy: that brings a round due at the
earliest once this group trained ``target / (1 + (galaxy size - 1) × OTHERS_CAP)`` tokens of it (`earliest`),
against about ``target / galaxy size`` among equal groups; no record, however large or numerous, brings it
earlier. Honest groups up to ``OTHERS_CAP`` times as fast as this one count in full; a faster one is cut in the
slow group's estimate, which then comes to the round a little after the others (they wait for it in
matchmaking) or, past their matchmaking time, catches up by loading their state.

The median of the groups' tokens would cap a stranger as well where it held a minority of the world ranks, but a
stranger can sign records for all of them; this group's own tokens are the one number it cannot touch.

Plain Python: the DHT is any object with hivemind's ``store`` / ``get`` (``progress.Store``), so importing this
costs no hivemind.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from diloco.swarm.records.ownership import Refused, owned_records
from diloco.swarm.records.progress import Store

TOKENS_TTL = 60.0  # seconds a record lives without a refresh
HORIZON_S = 30.0  # a record is extrapolated at most this far: a group gone silent stops adding tokens
# another group counts at most this many times this group's own tokens in the round: above the speed ratios of
# honest groups (the hetero bench's fastest group trains 4.6 times the tokens of its slowest in a round), and the
# bound on how much earlier a stranger's records can bring a round (see the module's docstring)
OTHERS_CAP = 8.0


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
    :param step_s: seconds one of its inner steps takes (0: not known yet); `at` is the end of one, so the others
        know when its next ends (`step_ends`).
    :param owner: who signed the record (``ownership.owner_id``), from its subkey; not part of the value.
    """

    world_rank: int
    outer_step: int
    tokens: int
    tokens_per_s: float
    at: float
    closed: bool = False
    step_s: float = 0.0
    owner: str = field(default="", compare=False)

    def now(self, now: float) -> float:
        """Its tokens extrapolated to wall-clock time `now`."""
        if self.closed:
            return float(self.tokens)
        return self.tokens + self.tokens_per_s * min(max(now - self.at, 0.0), HORIZON_S)

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if key != "owner"}

    @classmethod
    def from_dict(cls, data: Any) -> RoundTokens | None:
        """A record read back from the DHT; None when it is not one."""
        if not isinstance(data, dict) or "owner" in data:  # the owner is the subkey's, never the value's
            return None
        try:
            record = cls(**data)
        except TypeError:
            return None
        numbers = (record.tokens, record.tokens_per_s, record.at, record.step_s)
        ints = isinstance(record.world_rank, int) and isinstance(record.outer_step, int)
        ints = ints and isinstance(record.closed, bool)
        # (compared, not converted: an int past float's range is refused, not an OverflowError)
        finite = all(isinstance(n, (int, float)) and 0 <= n < 2**63 for n in numbers)
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
    return [replace(record, owner=owner) for owner, record in owned_records(found, RoundTokens.from_dict, refused)]


def swarm_tokens(records: Iterable[RoundTokens], mine: RoundTokens, now: float, galaxy_size: int) -> float:
    """The swarm's tokens in this group's round at `now`: its own, exact, plus every other group's of the galaxy
    training for the same round, extrapolated, one record per world rank, each at most ``OTHERS_CAP`` times this
    group's own (see the module's docstring)."""
    cap = OTHERS_CAP * mine.tokens
    others: dict[int, float] = {}
    for r in records:
        if r.outer_step == mine.outer_step and r.world_rank != mine.world_rank and 0 <= r.world_rank < galaxy_size:
            others[r.world_rank] = max(others.get(r.world_rank, 0.0), min(r.now(now), cap))
    return mine.tokens + sum(others.values())


def own_share(records: Iterable[RoundTokens], mine: RoundTokens, galaxy_size: int) -> float:
    """This group's share of the swarm's rate: its own rate over the sum of its own and every other group's of the
    galaxy, each the one of its latest record at any outer step (a rate carries over from one round to the next, so
    a new round's share is known at its first step, before any record of it is read) and at most ``OTHERS_CAP``
    times this group's own. Where no other group has a record yet, the galaxy's groups count as equal:
    ``1 / galaxy_size``, as when this group's own rate is not known yet. Only for where the LR schedule stands
    (``diloco.outer.pace.TokenBudget``): a stranger's rates can move this group's schedule within a round, never
    bring a round due."""
    if mine.tokens_per_s <= 0:
        return 1.0 / galaxy_size
    latest: dict[int, RoundTokens] = {}
    for r in records:
        if r.world_rank != mine.world_rank and 0 <= r.world_rank < galaxy_size:
            if r.world_rank not in latest or r.at > latest[r.world_rank].at:
                latest[r.world_rank] = r
    if not latest:
        return 1.0 / galaxy_size
    others = sum(min(r.tokens_per_s, OTHERS_CAP * mine.tokens_per_s) for r in latest.values())
    return mine.tokens_per_s / (mine.tokens_per_s + others)


def latest(records: Iterable[RoundTokens], mine: RoundTokens, galaxy_size: int) -> dict[int, RoundTokens]:
    """By world rank, the newest record of every other group of the galaxy training for `mine`'s round."""
    found: dict[int, RoundTokens] = {}
    for r in records:
        if r.outer_step == mine.outer_step and r.world_rank != mine.world_rank and 0 <= r.world_rank < galaxy_size:
            if r.world_rank not in found or r.at > found[r.world_rank].at:
                found[r.world_rank] = r
    return found


def step_ends(records: Iterable[RoundTokens], mine: RoundTokens, now: float, galaxy_size: int, came_due: float,
              longer_than: float = 0.0) -> dict[int, float]:  # fmt: skip
    """By world rank, when each other group of the galaxy still training for `mine`'s round, of steps longer than
    `longer_than` seconds, ends the inner step it is in at `now` (wall clock). A record's `at` ends a step of its
    group (the record not closed: the round was not due then), and the next ones follow every `step_s`. A step that
    ended before `came_due`, when the swarm's tokens reached the target by this group's estimate, did not find the
    round due either (the groups' estimates agree), so the group went on training: its step under way ends one
    `step_s` after the last that did. A group that ended a step after `came_due` may be in the round (its record
    saying so not read yet): none. Left out as well: groups in the round (closed), records without a step time and
    records written after `now` (another clock)."""
    ends = {}
    for rank, r in latest(records, mine, galaxy_size).items():
        if r.closed or r.step_s <= max(longer_than, 0.0) or r.at > now:
            continue
        step = min(r.step_s, HORIZON_S)
        last = r.at + math.floor((now - r.at) / step) * step  # the last step end at or before now
        if last == r.at or last < came_due:
            ends[rank] = last + step
    return ends


def closed(records: Iterable[RoundTokens], mine: RoundTokens, galaxy_size: int) -> set[int]:
    """The world ranks of the other groups whose newest record of `mine`'s round says they are in it (closed)."""
    return {rank for rank, r in latest(records, mine, galaxy_size).items() if r.closed}


def earliest(target: float, galaxy_size: int) -> float:
    """The fewest tokens of its own with which a group can find a round of `target` tokens due: every other world
    rank of the galaxy at its cap (`swarm_tokens`)."""
    return target / (1 + (galaxy_size - 1) * OTHERS_CAP)


def claims_ahead(records: Iterable[RoundTokens], mine: RoundTokens, galaxy_size: int | None = None
                 ) -> dict[int, list[RoundTokens]]:  # fmt: skip
    """By world rank (of the galaxy, when its size is given), the other groups' records saying they already took the
    outer step this group trains for (it would be behind: go to the round, which loads the swarm's state). Only
    claims, which anyone can make: ``diloco.outer.pace.TokenBudget`` acts on one once a progress record corroborates
    it."""
    claims: dict[int, list[RoundTokens]] = {}
    for r in records:
        in_galaxy = galaxy_size is None or r.world_rank < galaxy_size
        if r.outer_step > mine.outer_step and r.world_rank != mine.world_rank and in_galaxy:
            claims.setdefault(r.world_rank, []).append(r)
    return claims


def ahead(records: Iterable[RoundTokens], mine: RoundTokens) -> bool:
    """Whether any other group's record claims to be ahead of this group (``claims_ahead``)."""
    return bool(claims_ahead(records, mine))

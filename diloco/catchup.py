"""Which worker group holds the swarm's state, for a group that joins late, resumes, or fell out of step.

Every group publishes one progress record in the DHT (its rank 0 does, at start and after each outer step).
A group compares its own record with the live ones of the others: the swarm's state is the one with the
highest outer step; between groups at the same outer step, a state that came out of a full average beats one
that did not (a lone or failed round), then the state more groups hold, then the lowest world rank. This order
is the same for everyone, so groups that diverged (a round that succeeded for some and failed for others, or
two halves of a split swarm) converge again on one state. Plain Python: no torch, no hivemind.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Progress:
    """One worker group's published progress.

    :param world_rank: the group's --hv.world-rank.
    :param outer_step: outer steps applied to its outer parameters.
    :param step: inner steps done when the record was written.
    :param digest: sha256 over the outer parameters of all its ranks (equal digests: identical states).
    :param tainted: its last outer step was not a full average (it averaged alone, the round failed, or its
        ranks averaged with different peers).
    :param settled: it has joined the swarm (loaded the state or found it was the first), so others may
        download from it.
    :param token: random per start of a group; two different tokens for one world rank are two groups.
    :param peers: peer id of each rank's averager, in rank order (rank r downloads from rank r).
    :param done: it took its last inner step and waits for the others to hold the same final state.
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

    @property
    def state(self) -> tuple[int, str]:
        return self.outer_step, self.digest

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peers": list(self.peers)}

    @classmethod
    def from_dict(cls, data: Any) -> Progress | None:
        """A record read back from the DHT; None when it is not one (another version, garbage)."""
        try:
            record = cls(**{**data, "peers": tuple(data["peers"])})
        except (TypeError, KeyError):
            return None
        return record if all(isinstance(p, str) for p in record.peers) else None


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

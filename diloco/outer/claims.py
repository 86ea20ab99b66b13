"""Claims of a world rank: one world rank is one worker group (its data shard, its records).

Before a group trains it looks for a live group that already holds its world rank (`Claims.rival`): then it is
the later one and leaves. Once it holds the rank (`Claims.hold`), a record of that rank signed by another owner
(``Progress.owner``, ``diloco.swarm.records.ownership``) is a rejected claim: a stranger in an open swarm, or a group
started later with a wrong flag before it noticed. No group takes a record of its own world rank as a source, so
ignoring it costs nothing; it is logged once per claimant and counted (``rejected_claims`` in ``summary.json``).
Other groups keep both records apart by owner: the claimant can neither replace nor alter this group's.

Rank 0 decides; nothing here is collective.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from diloco.outer.links import Swarm
from diloco.swarm.records.progress import Progress

log = logging.getLogger("diloco")

# pings a group that holds a record must miss before it counts as gone: on a loaded machine a live group's DHT can
# miss one (seen in the suite), and a newcomer that takes a live group for dead trains on its data shard
ALIVE_TRIES = 3
ALIVE_GAP_S = 2.0  # between two tries: a failure that comes at once (an overloaded p2pd) may pass a moment later


class Claims:
    """This group's view of who else claims its world rank.

    :param swarm: the records, this group's owner and liveness.
    :param world_rank: the rank this group claims.
    :param token: random per start of this group (its own records carry it).
    """

    def __init__(self, swarm: Swarm, world_rank: int, token: str) -> None:
        self.swarm, self.world_rank, self.token = swarm, world_rank, token
        self.held = False
        self.gap_s = ALIVE_GAP_S
        self.claimants: set[str] = set()  # owners of live rejected claims, each logged once
        self._dead: set[str] = set()  # owners of records of this rank found dead (a predecessor's, left to expire)

    def rival(self) -> str | None:
        """Peer id of another live group holding this world rank, if any (before `hold`)."""
        for record in self.swarm.records():
            if record.world_rank == self.world_rank and record.token != self.token and record.peers:
                # this group's own earlier life (a resume: same owner key) is asked once, as its ping to a peer
                # that just stopped can take the DHT's whole wait (a resume took 141 s instead of 28 with 3 tries)
                tries = 1 if record.owner == self.swarm.owner else ALIVE_TRIES
                if self.answers(record.peers[0], tries):
                    return record.peers[0]
        return None

    def answers(self, peer: str, tries: int = ALIVE_TRIES) -> bool:
        """Whether `peer` answers one of `tries` pings, `gap_s` apart. A gone DHT's ping failed in
        milliseconds on loopback, a just-stopped one's can take the DHT's whole wait: each try may cost that."""
        for attempt in range(tries):
            if attempt:
                time.sleep(self.gap_s)
            if self.swarm.alive(peer):
                return True
        return False

    def hold(self) -> None:
        """This group holds its world rank from now on: later claims are rejected."""
        self.held = True

    def check(self, records: Iterable[Progress]) -> None:
        """Reject (log once, count) each live record of this world rank that another owner signed."""
        if not self.held:
            return
        for record in records:
            owner = record.owner
            if record.world_rank != self.world_rank or owner in ("", self.swarm.owner):
                continue
            if owner in self.claimants or owner in self._dead:
                continue
            if not (record.peers and self.swarm.alive(record.peers[0])):
                self._dead.add(owner)  # a group that held this rank before and died: its record expires
                continue
            self.claimants.add(owner)
            log.warning(
                "ignoring a record that claims this group's world rank %d (owner %s, peer %s): a stranger, or a "
                "group started with a taken --hv.world-rank; this group keeps the rank", self.world_rank, owner,
                record.peers[0],
            )  # fmt: skip

    @property
    def rejected(self) -> int:
        return len(self.claimants)

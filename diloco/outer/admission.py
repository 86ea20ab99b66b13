"""Admission to the swarm: a group's claim of its world rank, its check that the run's live groups train the same
model with the same settings, and, under a token budget, its adoption of the swarm's budget. Part of `DiLoCo` (a base
class of it: the methods use its swarm, group, claims, pace and beacon), kept apart as the one concept they share.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from diloco.errors import FieldError
from diloco.outer.agreement import budget_to_adopt, mismatch_error, rival_model, with_budget
from diloco.swarm.records.status import Status

if TYPE_CHECKING:
    from diloco.outer.beacon import Beacon
    from diloco.outer.claims import Claims
    from diloco.outer.links import Group, Swarm
    from diloco.outer.pace import Pace
    from diloco.swarm.records.fingerprint import ModelId

log = logging.getLogger("diloco")


class Admission:
    """`DiLoCo`'s claim of its world rank and adoption of the swarm's token budget (see the module)."""

    swarm: Swarm
    group: Group
    claims: Claims
    pace: Pace
    beacon: Beacon
    model: ModelId | None
    world_rank: int
    peers: list[str]
    claim_settle_s: float
    if TYPE_CHECKING:  # `DiLoCo`'s

        def _publish(self) -> None: ...

        def _publish_status(self, state: str, step: int | None = None) -> Status | None: ...

        def _status(self, state: str) -> Status | None: ...

    def claim_world_rank(self, keyed: bool = True) -> None:
        """Collective, before anything is written: two running groups with one world rank would train on one
        data shard and overwrite each other's progress record, so the later one leaves (a `FieldError` naming
        `world_rank`). A live group of another model or setting (`rival_model`) makes it leave too when the swarm is
        `keyed` (only members publish there: an operator's mistake); in an open swarm anyone can publish such a
        record, so it gets one warning line and the group trains on (other models never meet it: `run_key`)."""
        verdict = other_model = None
        if self.group.is_main:
            verdict = self.claims.rival()
            if verdict is None:
                self._adopt_budget(self._status("joining"))
                self._publish()
                joining = self._publish_status("joining")
                time.sleep(self.claim_settle_s)  # a group starting at the same moment: the later record wins
                verdict = self.claims.rival()
                records = self.swarm.status_records()
                if self._adopt_budget(joining, records):  # (only a later group adopts: its record only gets later)
                    joining = self._publish_status("joining")
                other_model = rival_model(joining, records, self.claims.answers)
        verdict, other_model = self.group.broadcast((verdict, other_model))
        self._share_budget()
        if other_model is not None:
            b = self.beacon
            error = mismatch_error(other_model, self.model, b.outer, b.schedule, b.batch)
            if keyed:
                raise error
            if self.group.is_main:
                log.warning("%s (in an open swarm anyone can publish such a status record: training on)", error)
        if verdict is not None:
            raise FieldError(
                f"{{world_rank}} {self.world_rank} is taken by a running worker group (peer {verdict}); give each "
                "group its own world rank",
            )
        self.claims.hold()
        if self.group.is_main:
            model = f" (model: {self.model})" if self.model else ""
            log.info("worker group %d joined the swarm as peer %s%s", self.world_rank, self.peers[0], model)

    def _share_budget(self) -> None:
        """Collective: every rank paces by the token budget rank 0 holds (it may have taken the swarm's)."""
        budget = self.group.broadcast(self.pace.budget())
        if budget != self.pace.budget():
            self.pace.adopt(budget)

    def _adopt_budget(self, mine: Status | None, records: list[Status] | None = None) -> bool:
        """Rank 0, under a token budget: take the swarm's N and length in rounds (``agreement.budget_to_adopt``) from
        the status `records` (default: read now). Returns whether anything changed."""
        ours = self.pace.budget()
        if ours is None or mine is None:
            return False
        records = self.swarm.status_records() if records is None else records
        theirs = budget_to_adopt(ours, self.pace.follows_h, mine, records, self.claims.answers)
        if theirs is not None:
            self.pace.adopt(theirs)
            self.beacon.schedule = with_budget(self.beacon.schedule, theirs)
            log.info("taking the swarm's token budget: %d tokens per round, %d rounds", *theirs)
        return theirs is not None

"""Progress records and state transfer: a group's record of its outer state, the plan of states to load, the state it
serves to others, and loading another group's state (with what that does to its inner steps since its last round).
Part of `DiLoCo` (a base class of it: the methods use its params, ledger, pace and catch-up), kept apart as the one
concept they share, as `Admission` is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from diloco.swarm.records.progress import Progress

if TYPE_CHECKING:
    from diloco.outer.beacon import Beacon
    from diloco.outer.catchup import CatchUp
    from diloco.outer.claims import Claims
    from diloco.outer.error_feedback import ErrorFeedback, NoFeedback
    from diloco.outer.ledger import Ledger
    from diloco.outer.links import Group, State, Swarm
    from diloco.outer.optimizer import OuterOptimizer
    from diloco.outer.pace import Pace
    from diloco.swarm.rounds.digest import Digest
    from diloco.swarm.rounds.transfer import SharedCopies

log = logging.getLogger("diloco")


class StateTransfer:
    """`DiLoCo`'s progress record and its loads of other groups' states (see the module)."""

    swarm: Swarm
    group: Group
    params: OuterOptimizer
    ledger: Ledger
    pace: Pace
    beacon: Beacon
    claims: Claims
    catchup: CatchUp
    feedback: ErrorFeedback | NoFeedback
    digester: Digest
    served: SharedCopies
    world_rank: int
    peers: tuple[str, ...]
    token: str
    step: int
    digest: str
    tainted: bool
    settled: bool
    done: bool
    keep_late: bool
    round_failed: bool
    keeping: bool
    loaded_from: int | None
    loaded_step: int | None
    loaded_from_peers: bool
    downloads: int
    download: dict[str, float]
    downloaded: list[dict[str, float]]
    stop: Callable[[], bool]
    wire_step: int | None
    if TYPE_CHECKING:  # `DiLoCo`'s

        @property
        def outer_step(self) -> int: ...

        @property
        def _paced(self) -> int: ...

        def _new_round(self, step: int, fragment: int | None = None) -> None: ...

    def _discard(self, steps: int) -> None:
        """`steps` inner steps of this group were thrown away (its model reset without them)."""
        if self.ledger.discard(steps):
            self.beacon.discarded_steps = total = self.ledger.discarded_steps
            if self.group.is_main:
                log.warning("discarded %d inner step(s) of this group (%d in this run)", steps, total)

    def _update_digest(self) -> None:
        """Collective: the group's digest of its outer state (parameters and momentum: what a download loads)."""
        started = time.monotonic()
        with self.params.lock:
            self.digest = self.digester.combine(self.group.gather(self.digester.partial(*self.params.tensors())))
        self.params.timings["digest_s"] = time.monotonic() - started

    def _record(self) -> Progress:
        return Progress(
            world_rank=self.world_rank,
            outer_step=self.outer_step,
            step=self.step,
            digest=self.digest,
            tainted=self.tainted,
            settled=self.settled,
            token=self.token,
            peers=self.peers,
            done=self.done,
        )

    def _publish(self) -> None:
        if self.group.is_main:
            self.swarm.publish(self._record())

    def _plan(self) -> list[list[Progress]]:
        """Rank 0: the states to load, best first (``CatchUp.plan``); other owners' claims of this group's world
        rank are rejected on the way (``Claims.check``)."""
        records = self.swarm.records()
        self.claims.check(records)
        return self.catchup.plan(self._record(), records)

    def _plan_later(self) -> list[list[Progress]]:
        """Rank 0: `_plan`'s states of a later outer step than this group's."""
        later = ([r for r in holders if r.outer_step > self.outer_step] for holders in self._plan())
        return [holders for holders in later if holders]

    def _plan_ahead(self, deadline: float) -> list[list[Progress]]:
        """Rank 0: `_plan_later`, once there are any, reading the records every half second until `deadline`
        (``time.monotonic``; empty: none came, or the run is stopping)."""
        while not self.stop():
            plan = self._plan_later()
            if plan or time.monotonic() >= deadline:
                return plan
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return []

    def _current_state(self) -> State:
        """This rank's outer state as served to other groups (called from the swarm's background thread)."""
        with self.params.lock:  # the metadata and the tensors of one moment
            meta = {
                "outer_step": self.outer_step,
                "step": self.step,
                "digest": self.digest,
                "tainted": self.tainted,
                "world_rank": self.world_rank,
                "round_step": self.wire_step,
            }
            return meta, self.served.get(self.params.tensors())

    def _load_from(self, plan: list[list[Progress]]) -> int | None:
        """Collective: load the outer state of the first group of `plan` that sends every rank the same state
        (``CatchUp.fetch``). Returns the inner step to continue from, or None when no group could."""
        outer_before, started = self.outer_step, time.monotonic()
        found = self.catchup.fetch(plan)
        if found is None:
            return None
        record, meta, tensors = found
        self.download = {"download_s": time.monotonic() - started,  # refused sources included; the digest checked
                         "download_mb": self.group.sum(sum(t.nbytes for t in tensors) / 1e6)}  # fmt: skip
        self.downloaded.append(self.download)  # (a load at the join has no row of its own)
        trained = self.ledger.trained(self.step)
        # this group's round failed on its side while the source took it alone: the state holds none of the inner
        # steps this group brought on time, and they are kept whatever --hv.late-work says (else a lost connection
        # costs a round of work). A source that averaged may hold them (a torn round): not kept then, unless asked
        split = self.round_failed and bool(meta["tainted"]) and meta["outer_step"] == outer_before + 1
        keep = (self.keep_late or split) and trained > 0  # (nothing trained: the model is reset to the state exactly)
        self.round_failed, self.keeping = False, keep
        if self.tainted:  # the round it applied alone is not in the state it loads
            self._discard(self.ledger.alone_steps)
        self.ledger.alone_steps = 0
        self._load(meta, tensors, keep)
        # a source with a round on the wire serves the state from before that round, with the inner steps it took since
        # counted in its step: a group behind goes to that round's boundary instead, where its source stood, and joins
        # the round (the source's matchmaking counts it in). At the source's step it would be out of that round, an
        # outer step behind when it lands, and behind again at its next boundary, where the same happens
        at = meta["step"] if meta.get("round_step") is None else meta["round_step"]
        self.loaded_from, self.loaded_step = record.world_rank, at
        if self.group.is_main:
            wire = "" if meta.get("round_step") is None else f" (its round of inner step {at} on the wire)"
            log.info(
                "loaded the outer state of worker group %d: outer step %d, inner step %d%s",
                record.world_rank, meta["outer_step"], meta["step"], wire,
            )  # fmt: skip
            if keep and not self.keep_late:
                log.info("keeping this group's %d inner step(s): its round failed on its side, and that group took "
                         "the round alone, without them", trained)  # fmt: skip
        # a group that was behind adopts the inner step count; one that diverged at the same outer step keeps its
        # own (it did the same number of inner steps). Never backwards: a source that finished the round this group
        # failed may not have reached this group's next boundary yet. Under a token budget every group keeps its own
        ahead = meta["outer_step"] > outer_before and self.pace.adopts_step
        step = max(at, self.step) if ahead else self.step
        if keep:  # the model moved with the outer parameters: its inner steps since each reset stay in it
            self.ledger.kept(trained, step - self.step, step)  # (an adopted step count moves the starts along)
            self.pace.new_round(self._paced)
        else:
            self._discard(trained)
            self._new_round(step)  # the model holds the loaded outer parameters: the inner steps since are gone
        return step

    def _load(self, meta: dict[str, Any], tensors: list[torch.Tensor], keep: bool = False) -> None:
        with self.params.lock:
            self.params.load(meta["outer_step"], tensors, keep)
            self.tainted = bool(meta["tainted"])
            self.feedback.reset()
            self._update_digest()
        self.loaded_from_peers = True
        self.downloads += 1

    def _swarm_past(self) -> bool:
        """Collective: whether a live group's record holds a later outer step than this group's (rank 0 reads)."""
        return bool(self.group.broadcast(bool(self._plan_later()) if self.group.is_main else None))

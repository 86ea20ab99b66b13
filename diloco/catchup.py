"""Catching up: which group's outer state to download, and whether what came is that state.

A group that joins, falls behind or finds its state unlike the swarm's asks the groups that hold a better one
(`diloco.swarm.progress.sources`, best first). Every rank of the group downloads its own shard of the state from
the same source; the group takes it only when every rank got one and the same state in full and the ranks' parts
add up to the digest it was served with (`diloco.swarm.digest`). Answers refused again and again (a stranger's
forged record, a state of another model) are skipped until their group moves on (`diloco.swarm.progress.Refused`),
so they can neither keep a group from starting nor hold it at its boundaries.

Loading the state it returns is the caller's (``diloco.membership.DiLoCo``): the parameters, the digest and the
served metadata change under one lock there.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from diloco.links import Group, State, Swarm
from diloco.outer import OuterOptimizer
from diloco.swarm.digest import Digest
from diloco.swarm.progress import Progress, Refused, sources

log = logging.getLogger("diloco")

Found = tuple[Progress, dict[str, Any], list[torch.Tensor]]  # the source's record, the state's metadata, tensors


class CatchUp:
    """One rank's side of the group's state downloads (methods marked collective: every rank of the group together).

    :param swarm: the progress records, liveness and the downloads themselves.
    :param group: collectives over the ranks of this group.
    :param params: this rank's outer state, which a download must fit.
    :param digester: how the ranks' parts add up to a group's digest.
    """

    def __init__(self, swarm: Swarm, group: Group, params: OuterOptimizer, digester: Digest) -> None:
        self.swarm, self.group, self.params, self.digester = swarm, group, params, digester
        self.rejected_states = 0  # downloaded states that did not fit this rank's shard, or not their digest
        self.refused = Refused()  # (the same on every rank: what the group refused together)
        self._warned: set[str] = set()  # tokens of the groups whose state could not be loaded, warned about

    def plan(self, mine: Progress, records: list[Progress]) -> list[list[Progress]]:
        """Rank 0: the states to load for a group whose record is `mine`, best first, from every group's `records`
        (see `sources`), but those refused too often (`Refused`)."""
        plan = sources(records, mine, lambda r: self.swarm.alive(r.peers[0]))
        return self.refused.prune(plan)

    def fetch(self, plan: list[list[Progress]]) -> Found | None:
        """Collective: download the state of the first group of `plan` that sends every rank the same state, whole
        (not loaded yet). None when no group could."""
        for holders in plan:
            for record in holders:
                before = self.refusals_here
                got = self.swarm.download_state(record, self.group.rank)
                meta = self._valid(got)
                part = None if meta is None else self.digester.partial(got[1][0])
                seen = self.group.gather(None if meta is None else (meta["outer_step"], meta["step"], meta["digest"]))
                parts = self.group.gather(part)
                # every rank got one state, and all of it: the ranks' parts add up to the digest it was served with
                whole = all(s is not None for s in seen) and len(set(seen)) == 1
                if not whole or self.digester.combine(parts) != seen[0][2]:
                    self._refused(record, whole, self.refusals_here > before)
                    continue
                return record, meta, got[1]
        return None

    @property
    def refusals_here(self) -> int:
        """State answers this rank refused: misfits here, the rest in the swarm's transfer."""
        return self.rejected_states + self.swarm.rejected_states

    def _refused(self, record: Progress, whole: bool, refused_here: bool) -> None:
        """Collective: a download from `record`'s group failed. An answer that came whole but does not add up to
        its digest, or that a rank refused, counts against that state (`Refused`); one warning per group start."""
        if self.group.sum(float(refused_here)) or whole:
            self.refused.note(record)
            if whole and self.group.is_main:
                self.rejected_states += 1  # values that do not add up to the digest they were served with
        if self.group.is_main:
            warn = log.warning if record.token not in self._warned else log.debug
            warn("could not load the state of worker group %d; trying the next", record.world_rank)
            self._warned.add(record.token)

    def _valid(self, got: State | None) -> dict[str, Any] | None:
        """The metadata of a downloaded state that fits this rank's shard, else None."""
        if got is None:
            return None
        meta, tensors = got
        try:
            typed = all(isinstance(meta[k], t) for k, t in (("outer_step", int), ("step", int), ("digest", str)))
            if typed and self.params.fits(tensors):
                return meta
        except (IndexError, KeyError, TypeError, AttributeError, RuntimeError):
            pass
        self.rejected_states += 1  # an answer in full that is not a state of this model
        return None

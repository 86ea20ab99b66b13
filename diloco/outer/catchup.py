"""Catching up: which group's outer state to download, and whether what came is that state.

Which group holds the swarm's state (`sources`): a group compares its own progress record
(``diloco.swarm.records.progress``) with the live ones of the others: the swarm's state is the one with the highest
outer step; between groups at the same outer step, a state that came out of a full average beats one that did not
(a lone or failed round), then the state more groups hold, then the lowest world rank. This order is the same for
everyone, so groups that diverged (a round that succeeded for some and failed for others, or two halves of a split
swarm) converge again on one state.

A group that joins, falls behind or finds its state unlike the swarm's asks the groups that hold a better one
(`sources`, best first). Every rank of the group downloads its own shard of the state from
the same source; the group takes it only when every rank got one and the same state in full, that state is the one
the source's owner signed in its progress record (its outer step and digest: what `sources` ranked it by, not what
the source says of it when asked), and the ranks' parts add up to that digest (`diloco.swarm.rounds.digest`, which
nobody can forge). A group whose record lags its state (it took an outer step after this group read its record) is
refused this once: the group tries the next holder, again a second later when joining, or at its next boundary.
Answers refused again and again (a stranger's forged record, a state of another model) are skipped until their
group moves on (`Refused`), so they can neither keep a group from starting nor hold it at its boundaries.

Loading the state it returns is the caller's (``diloco.outer.diloco.DiLoCo``): the parameters, the digest and the
served metadata change under one lock there.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from diloco.outer.links import Group, State, Swarm
from diloco.outer.optimizer import OuterOptimizer
from diloco.swarm.records.progress import Progress
from diloco.swarm.rounds.digest import Digest

log = logging.getLogger("diloco")

class JoinError(RuntimeError):
    """This group could not take its place in the swarm (e.g. no live group ahead of it sent its state)."""


REFUSALS_BEFORE_SKIP = 3  # refused answers for one state of one group before a running group stops asking for it

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
        self.rejected_states = 0  # downloaded states that did not fit this rank's shard, or not the record's
        self.refused = Refused()  # (the same on every rank: what the group refused together)
        self._warned: set[str] = set()  # tokens of the groups whose state could not be loaded, warned about

    def plan(self, mine: Progress, records: list[Progress]) -> list[list[Progress]]:
        """Rank 0: the states to load for a group whose record is `mine`, best first, from every group's `records`
        (see `sources`), but those refused too often (`Refused`)."""
        plan = sources(records, mine, lambda r: self.swarm.alive(r.peers[0]))
        return self.refused.prune(plan)

    def fetch(self, plan: list[list[Progress]]) -> Found | None:
        """Collective: download the state of the first group of `plan` that sends every rank the state its record
        names, whole (not loaded yet). None when no group could."""
        for holders in plan:
            for record in holders:
                before = self.refusals_here
                # an answer of another state than the signed one is cut after its metadata: no buffers for it
                got = self.swarm.download_state(record, self.group.rank, functools.partial(named_in, record=record))
                meta = self._valid(got, record)
                seen = self.group.gather(None if meta is None else (meta["outer_step"], meta["step"], meta["digest"],
                                                                     meta.get("round_step")))  # fmt: skip
                whole = all(s is not None for s in seen) and len(set(seen)) == 1
                # the state its owner signed, not one the source names when asked; hashed only then (seconds for a
                # large model) and on every rank together (`seen` is every rank's)
                named = whole and (seen[0][0], seen[0][2]) == record.state
                digest = self.digester.combine(self.group.gather(self.digester.partial(*got[1]))) if named else None
                if digest == record.digest:
                    return record, meta, got[1]  # every rank got all of the signed state
                # a state served one outer step ahead of its record: the group moved on before its record did (an
                # honest race, not counted as a refusal; that record's state is not asked for again all the same)
                lagging = whole and seen[0][0] == record.outer_step + 1
                if not whole:
                    why = "not every rank got it whole"
                elif lagging:
                    why = f"its record names outer step {record.outer_step}, it has moved on to {seen[0][0]}"
                elif seen[0][0] != record.outer_step:
                    why = f"it served outer step {seen[0][0]}, its record names outer step {record.outer_step}"
                elif not named:
                    why = "it served another digest than its record names"
                else:
                    why = "its values do not add up to its digest"
                self._refused(record, whole, self.refusals_here > before, why, lagging)
        return None

    def on_join(self, plan: Callable[[], list[list[Progress]]], load: Callable[[list[list[Progress]]], int | None],
                timeout: float, stop: Callable[[], bool]) -> int | None:  # fmt: skip
        """Collective, on joining: load (`load`, the caller's) the state of a group `plan` (rank 0's) finds ahead,
        trying for `timeout` seconds. Returns the inner step to continue from, or None when this group is the first
        or the furthest (its own state is the swarm's), or was stopped; raises `JoinError` when groups ahead are
        live but none sent its state."""
        deadline = time.monotonic() + timeout
        seen: list[list[Progress]] = []  # the last non-empty plan of this join
        while True:
            found, expired, stopped = self.group.broadcast(
                (plan(), time.monotonic() > deadline, stop()) if self.group.is_main else None
            )
            if stopped:
                return None  # the run stops after its first step and checkpoints this group's own state
            # groups seen ahead that vanish (a DHT read that came back empty, pings lost under load) are not
            # proof that this group is the first: keep trying them until the deadline, unless their answers were
            # refused too often (a stranger's forged record would otherwise keep the swarm's first group out)
            refused_before = bool(seen)
            seen = found or self.refused.prune(seen)  # (`plan` pruned `found` already)
            if not seen:
                if self.group.is_main and refused_before:
                    log.warning("the groups ahead sent only states this group refused: starting from its own state")
                elif self.group.is_main:
                    log.info("no worker group is ahead of this one: starting from this group's own state")
                return None
            loaded = load(seen)
            if loaded is not None:
                return loaded
            if expired:
                raise JoinError(
                    f"could not download the swarm's state from {sum(map(len, seen))} live worker group(s) within "
                    f"{timeout:.0f} s; not starting from this group's own state, which would overwrite a trained "
                    "swarm"
                )
            time.sleep(1.0)

    def settle(self, plan: Callable[[], list[list[Progress]]], load: Callable[[list[list[Progress]]], int | None],
               mine: Callable[[], Progress], timeout: float, stop: Callable[[], bool],
               on_load: Callable[[], None]) -> bool:  # fmt: skip
        """Collective, after the last inner step: until every live group that is not done or holds another state
        than this one (`mine`) has caught up (at most `timeout` seconds, or until `stop`), load (`load`, then
        `on_load`) the best state whenever `plan` finds one (a torn last round: the groups whose round failed
        download the others' result). Returns whether a state was loaded."""
        deadline, loaded = time.monotonic() + timeout, False
        while True:
            expired = time.monotonic() > deadline or stop()
            found, waiting, expired = self.group.broadcast(
                (plan(), self.unsettled(mine()), expired) if self.group.is_main else None
            )
            if found and load(found) is not None:
                loaded = True
                on_load()
            if not waiting or expired:
                break
            time.sleep(0.5)
        if waiting and self.group.is_main:
            log.warning("worker group(s) %s did not reach this final state within %.0f s", waiting, timeout)
        return loaded

    def unsettled(self, mine: Progress) -> list[int]:
        """Rank 0: world ranks of the live groups that are not done or hold another state than `mine`'s."""
        pending = [
            r for r in self.swarm.records()
            if r.world_rank != mine.world_rank and r.settled and not (r.done and r.state == mine.state)
            and not self.refused.skipped(r)  # a group whose answers this one keeps refusing is not waited for
        ]  # fmt: skip
        return sorted(r.world_rank for r in pending if self.swarm.alive(r.peers[0]))

    @property
    def refusals_here(self) -> int:
        """State answers this rank refused: misfits here, the rest in the swarm's transfer."""
        return self.rejected_states + self.swarm.rejected_states

    def _refused(self, record: Progress, whole: bool, refused_here: bool, why: str, lagging: bool = False) -> None:
        """Collective: a download from `record`'s group failed (`why`). An answer that came whole but is not the state
        its record names or does not add up to its digest, or that a rank refused, counts against that state
        (`Refused`); one warning per group start. A `lagging` record (its group served a later state) is only
        noted."""
        if self.group.sum(float(refused_here)) or whole:
            self.refused.note(record)
            if whole and not lagging and self.group.is_main:
                self.rejected_states += 1  # not the signed state, or values that do not add up to its digest
        if lagging and self.group.is_main:
            log.info("did not load the state of worker group %d (%s); trying the next", record.world_rank, why)
        elif self.group.is_main:
            warn = log.warning if record.token not in self._warned else log.debug
            warn("could not load the state of worker group %d (%s); trying the next", record.world_rank, why)
            self._warned.add(record.token)

    def _valid(self, got: State | None, record: Progress) -> dict[str, Any] | None:
        """The metadata of a downloaded state that fits this rank's shard (``META``: each field of what
        ``DiLoCo._current_state`` serves, of its type), or of an answer cut after its metadata because it is not the
        state `record` names; else None."""
        if got is None:
            return None
        meta, tensors = got
        try:
            typed = isinstance(meta, dict) and all(meta.get(name) is not None and valid(meta[name])
                                                   for name, valid in META.items())  # fmt: skip
            typed = typed and all(meta.get(name) is None or valid(meta[name]) for name, valid in OPTIONAL.items())
            typed = typed and (meta.get("round_step") is None or meta["round_step"] <= meta["step"])
            if typed and ((not tensors and not named_in(meta, record)) or self.params.fits(tensors)):
                return meta  # (no tensors: an answer of another state, cut after its metadata)
        except (IndexError, KeyError, TypeError, AttributeError, RuntimeError):
            pass
        self.rejected_states += 1  # an answer in full that is not a state of this model
        return None


def named_in(meta: dict[str, Any], record: Progress) -> bool:
    """Whether a served state's metadata names the state `record` signs: its outer step and digest."""
    return (meta.get("outer_step"), meta.get("digest")) == record.state


def _count(value: Any) -> bool:
    """A whole number >= 0 that is not a bool (JSON keeps the two apart; Python's bool is an int)."""
    return type(value) is int and 0 <= value < 2**63


META: dict[str, Callable[[Any], bool]] = {  # what a served state's metadata holds, each field by its rule
    "outer_step": _count,
    "step": _count,
    "digest": lambda value: isinstance(value, str) and len(value) <= 256,
    "tainted": lambda value: isinstance(value, bool),
    "world_rank": _count,
}
OPTIONAL: dict[str, Callable[[Any], bool]] = {  # ... and what it may hold (absent or None: not there)
    "round_step": _count,  # (at most `step`)
}


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
    # a state whose holders all dial out only (behind home routers) cannot be downloaded: the next best is tried
    plan = [sorted((r for r in holders[s] if r.serves), key=lambda r: r.world_rank)
            for s in ranked[: ranked.index(mine.state)]]
    return [held for held in plan if held]


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

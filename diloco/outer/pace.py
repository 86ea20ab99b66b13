"""When a worker group takes its outer step, and where its LR schedule stands: the pace of the swarm.

- `FixedSteps` (``--hv.pace fixed``, OpenDiLoCo's mode): every group takes H inner steps per round; a fast group
  waits for the groups on their way (``diloco.swarm.records.arrivals``). The LR schedule follows its own steps.
- `TokenBudget` (``--hv.pace tokens``, or ``--hv.target-tokens N``): the swarm takes an outer step once its groups
  together trained N tokens since the last one; each keeps training until then, so nobody waits for the slowest, and
  each group's pseudo-gradient is weighted by its tokens. A group the round is due for trains on while a slower
  group ends the step it is in more than half a step of its own from now (``TokenBudget._hold``): the round forms
  when the slowest comes, with the others' last steps in it, not their idle wait. Under ``--hv.pace tokens`` N = H ×
  galaxy size × the tokens of an inner step of the group that sets it. The run lasts R rounds: the setter's
  ⌈max_steps ÷ H'⌉, H' = N ÷ (galaxy size × its tokens per inner step). N and R are announced in the setter's status
  record and every group that joins takes them (``adopt``; ``diloco.outer.agreement.budget_to_adopt``), whatever its
  batch and --max-steps. A group's own step count no longer says where the run is, so its LR schedule and its end
  follow the swarm's progress: its own `max_steps` inner steps spread over the R rounds, and within a round its
  tokens over its share of the swarm's rate (``budget.own_share``; equal groups: its own steps), not the swarm's
  estimated tokens, whose records of a new round are read a moment late (on three equal groups that schedule ended
  1-2.5% worse, docs/outer-step.md).

With ``--hv.fragments F`` a round averages one fragment, so both paces count fragment rounds: H/F inner steps, or
N/F tokens of the swarm, each. The outer loop passes the round a group trains for as `outer_step`: its applied
outer steps, plus one while an overlapped round is on the wire (that round's successor starts when it is sent).

Under a token budget no record a stranger can write makes a round due sooner than the group's own tokens allow:
other groups' tokens count up to a bound (``diloco.swarm.records.budget``), and a token record saying another group
is ahead (it took, or sent, the outer step this group trains for) counts only when that group's progress record
(same world rank and owner) corroborates it: settled, live, of a state this group has not refused, at this group's
outer step or later and at most one round behind the claim (the round it may have on the wire); and only once this
group trained as many tokens of the round as the bound on the others' lets a round be due (``budget.earliest``).
Otherwise a stranger's record of a huge outer step would send the group to a round at every inner step, each an
outer step of its own, and end its run early. A stranger that also keeps a progress record of its own and a live
peer can still bring this group's rounds due at that bound, no earlier; a state it serves is refused by the
catch-up as before (``diloco.outer.catchup``).

`diloco.outer.diloco.DiLoCo` asks its pace; neither knows the network beyond the `Swarm` protocol's records.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from diloco.config import HvConfig
from diloco.errors import FieldError
from diloco.swarm.records import budget
from diloco.swarm.records.budget import RoundTokens
from diloco.swarm.records.budget import earliest as budget_earliest

if TYPE_CHECKING:
    from diloco.outer.links import Group, Swarm
    from diloco.swarm.records.progress import Progress

PUBLISH_S = 1.0  # rank 0 refreshes its round-token record at most this often
CORROBORATE_S = 2.0  # while a token record says another group is ahead, its progress records are read this often
CORROBORATE_PINGS = 3  # progress records ahead whose peers one such read asks whether they are alive, at most
# a group due by the tokens trains on while a slower group ends its step, for at most this share of the round so far
# (a stranger's record of a slow group costs the swarm's rounds no more than that)
HOLD_SHARE = 0.25
HOLD_SLOWER = 1.25  # ... for a group whose steps take this many times its own: groups of about one speed hold for none
STEP_TIMES = 3  # a group's step time is the median of its last this many (an evaluation between two is one outlier)


class Pace(Protocol):
    adopts_step: bool  # a group that loads the swarm's state takes over the source's inner step count
    follows_h: bool  # a token budget whose N follows H: a group of another batch takes the swarm's N

    def due(self, step: int, outer_step: int, tokens: int) -> bool:
        """Collective, after each inner step: whether an outer step follows inner step `step` (`tokens`: this
        group's since its last outer step)."""
        ...

    def round_index(self, step: int, outer_step: int) -> int:
        """The index of that round: the same in every group that takes part."""
        ...

    def last_round(self, step: int, index: int) -> bool:
        """Whether round `index` at inner step `step` is the run's last (every fragment then takes a round)."""
        ...

    def in_round(self, step: int, outer_step: int) -> bool:
        """Whether a group that just loaded the swarm's state at inner step `step` is in the round in progress
        (it joins it, adding no weight)."""
        ...

    def next_boundary(self, outer_step: int) -> int | None:
        """The inner step of the round after outer step `outer_step`, the same in every group; None when rounds
        have no fixed inner step."""
        ...

    def position(self, step: int, outer_step: int) -> int:
        """Where the LR schedule and the end of the run stand after inner step `step`: the run ends once this
        reaches `max_steps`."""
        ...

    def weight(self, tokens: int) -> float:
        """This group's weight in the average of a round in which it trained `tokens`."""
        ...

    def new_round(self, outer_step: int) -> None:
        """The outer step changed (applied, or loaded from another group): a new round starts now."""
        ...

    def summary(self, tokens: int) -> dict[str, Any]:
        """Fields for the outer row of a round: what the swarm did in it."""
        ...

    def budget(self) -> tuple[int, int] | None:
        """Under a token budget: (tokens per round, rounds in the run), which every group of the swarm shares;
        None under fixed H."""
        ...

    def adopt(self, budget: tuple[int, int]) -> None:
        """Take the swarm's (tokens per round, rounds) announced by the group that set them."""
        ...


class FixedSteps:
    """H inner steps per round in every group; the run's last inner step also ends with an outer step.

    :param tokens_per_h: the group's tokens in H inner steps (a whole round's, or F fragment rounds'): a round that
        brings more, with inner steps kept from a round the group missed (``DiLoCo`` ``late_work``), weighs that
        many rounds; 0: every round weighs 1.
    """

    adopts_step = True
    follows_h = False

    def __init__(self, local_steps: int, final_step: int | None, tokens_per_h: int = 0) -> None:
        self.local_steps, self.final_step, self.tokens_per_h = local_steps, final_step, tokens_per_h

    def due(self, step: int, outer_step: int, tokens: int) -> bool:
        return step % self.local_steps == 0 or step == self.final_step

    def round_index(self, step: int, outer_step: int) -> int:
        # a last, shorter round after a final step that is not a multiple of H gets the next index
        return -(-step // self.local_steps)

    def last_round(self, step: int, index: int) -> bool:
        return step == self.final_step

    def in_round(self, step: int, outer_step: int) -> bool:
        return self.due(step, outer_step, 0) and self.round_index(step, outer_step) > outer_step

    def next_boundary(self, outer_step: int) -> int | None:
        boundary = (outer_step + 1) * self.local_steps
        return boundary if self.final_step is None else min(boundary, self.final_step)

    def position(self, step: int, outer_step: int) -> int:
        return step

    def weight(self, tokens: int) -> float:
        return max(1.0, tokens / self.tokens_per_h) if self.tokens_per_h else 1.0

    def new_round(self, outer_step: int) -> None:
        pass

    def summary(self, tokens: int) -> dict[str, Any]:
        return {}

    def budget(self) -> tuple[int, int] | None:
        return None

    def adopt(self, budget: tuple[int, int]) -> None:
        raise ValueError("fixed H has no token budget to adopt")


class TokenBudget:
    """An outer step every `target_tokens` tokens of the whole swarm (see the module's docstring).

    :param swarm: publishes and reads the groups' round-token records (rank 0 only).
    :param group: collectives over this group's ranks (rank 0 decides, every rank follows).
    :param world_rank: this group's world rank.
    :param target_tokens: N, the swarm's tokens per outer step (with F fragments, per fragment round: N / F).
    :param galaxy_size: the number of groups the swarm expects.
    :param tokens_per_step: tokens of one inner step of this group (all its ranks).
    :param max_steps: the run's length in inner steps of an average group.
    :param clock: wall-clock time (tests replace it).
    :param follows_h: N was not given but follows H (``--hv.pace tokens``): a group of another batch adopts the
        N of the group that set it (``adopt``), and so does a group whose N was given when the announced N is it.

    `refused` says whether this group refused the state of a progress record too often to ask for it again
    (``diloco.outer.catchup.Refused.skipped``; the builder sets the one of the group's catch-up): such a record
    corroborates no claim of being ahead.
    """

    adopts_step = False  # groups run different numbers of inner steps: each keeps its own count

    def __init__(
        self,
        swarm: Swarm,
        group: Group,
        *,
        world_rank: int,
        target_tokens: float,
        galaxy_size: int,
        tokens_per_step: int,
        max_steps: int,
        clock: Callable[[], float] = time.time,
        follows_h: bool = False,
    ) -> None:
        self.swarm, self.group, self.world_rank, self.clock = swarm, group, world_rank, clock
        self.target_tokens, self.max_steps = target_tokens, max_steps
        self.steps_per_round = target_tokens / (galaxy_size * tokens_per_step)  # H' of an average group
        self.final_outer_step = max(1, math.ceil(max_steps / self.steps_per_round - 1e-9))
        self.fraction = 0.0  # of the round done, as rank 0 last estimated it (the same on every rank)
        self.estimate = 0.0  # the swarm's tokens in the round, as rank 0 last estimated them
        self.round_started = clock()
        self.rate = 0.0  # this group's tokens/s in its last round, until the current one has a step
        self.published_at = -math.inf
        self.galaxy_size = galaxy_size
        self.earliest = budget.earliest(target_tokens, galaxy_size)  # own tokens before which no round is due
        self.refused: Callable[[Progress], bool] = lambda record: False
        self.follows_h = follows_h
        self.corroborated: tuple[int, float, bool] = (-1, -math.inf, False)  # (outer step, checked at, verdict)
        self.step_times: deque[float] = deque(maxlen=STEP_TIMES)  # seconds of this group's last inner steps
        self.stepped_at: float | None = None  # when its last inner step of this round ended
        self.due_at: float | None = None  # when the tokens first made this round due (`_hold`)
        self.undue: tuple[float, float] | None = None  # (time, estimate) of its last step end at which they had not
        self.arrivals: dict[int, float] = {}  # by world rank: when the slower groups then end their steps
        self.held_s = 0.0  # how long this group trained on past the moment its round came due (when due)

    # ---------------------------------------------------------------- every inner step

    def due(self, step: int, outer_step: int, tokens: int) -> bool:
        decision = self._decide(outer_step, tokens) if self.group.is_main else None
        due, self.fraction, self.estimate, self.held_s = self.group.broadcast(decision)
        return due

    def _decide(self, outer_step: int, tokens: int) -> tuple[bool, float, float, float]:
        """Rank 0: publish this group's progress (at most every `PUBLISH_S`), estimate the swarm's. Returns whether
        the round is due, where the schedule stands in it, the swarm's tokens in it and how long this group held."""
        now = self.clock()
        if tokens:
            self.rate = tokens / max(now - self.round_started, 1e-6)
        if self.stepped_at is not None:
            self.step_times.append(now - self.stepped_at)
        self.stepped_at = now
        mine = RoundTokens(self.world_rank, outer_step, tokens, self.rate, now, step_s=self.step_s)
        records = self.swarm.token_records()
        estimate = budget.swarm_tokens(records, mine, now, self.galaxy_size)
        claims = budget.claims_ahead(records, mine, self.galaxy_size)
        behind = tokens >= self.earliest and bool(claims) and self._corroborated(claims, mine)
        final = outer_step >= self.final_outer_step
        due = estimate >= self.target_tokens or behind or final
        if estimate < self.target_tokens:
            self.undue = (now, estimate)
        if due and not (behind or final) and self._hold(records, mine, estimate):
            due = False
        held = 0.0 if not due or self.due_at is None else now - self.due_at
        if due or now - self.published_at >= PUBLISH_S:
            # closed: this group waits in the round now; the others count its tokens as they are
            self.swarm.publish_tokens(replace(mine, closed=due))
            self.published_at = now
        # where the schedule stands: this group's tokens over its share of the round, not the swarm's estimate,
        # whose records of the round arrive a read late (a step or more behind at a round's start, then a jump)
        share = budget.own_share(records, mine, self.galaxy_size)
        return due, min(tokens / (share * self.target_tokens), 1.0), estimate, held

    @property
    def step_s(self) -> float:
        """Seconds an inner step of this group takes: the median of its last `STEP_TIMES` (0: none measured yet)."""
        return statistics.median(self.step_times) if self.step_times else 0.0

    def _hold(self, records: list[RoundTokens], mine: RoundTokens, estimate: float) -> bool:
        """Rank 0, the round due by the tokens: whether this group takes one more inner step first, because a slower
        group (steps ``HOLD_SLOWER`` times as long or more) ends the step it is in more than half a step of this
        group's from now (``budget.step_ends``, as of the moment the round first came due, `estimate` the swarm's
        tokens then). The round then forms when the slowest group comes, with the others' last steps in it rather
        than their idle wait; groups of about one speed hold for none. At most ``HOLD_SHARE`` of the round so far: a
        record, anyone's, holds rounds no longer."""
        if self.due_at is None:
            self.due_at = mine.at
            came_due = self._came_due(estimate, mine.at)
            self.arrivals = budget.step_ends(records, mine, mine.at, self.galaxy_size, came_due,
                                             longer_than=HOLD_SLOWER * mine.step_s)  # fmt: skip
        if mine.step_s <= 0 or mine.at - self.due_at >= HOLD_SHARE * (self.due_at - self.round_started):
            return False
        inside = budget.closed(records, mine, self.galaxy_size)  # came meanwhile: not waited for any longer
        # (its step ends within half of this group's own of the slower group's: one more would end further off)
        return any(end > mine.at + mine.step_s / 2 for rank, end in self.arrivals.items() if rank not in inside)

    def _came_due(self, estimate: float, now: float) -> float:
        """Rank 0: when the swarm's tokens reached the target, by this group's estimates: between its last step end
        at which they had not (`undue`) and `now`, at which they have, by linear interpolation."""
        if self.undue is None:
            return self.round_started
        then, before = self.undue
        return then + (now - then) * min(max((self.target_tokens - before) / max(estimate - before, 1e-9), 0.0), 1.0)

    def _corroborated(self, claims: dict[int, list[RoundTokens]], mine: RoundTokens) -> bool:
        """Rank 0: whether a group whose token record says it is past `mine`'s outer step (`claims`, by world rank:
        ``budget.claims_ahead``) shows it in a progress record: of the same world rank of the galaxy and owner,
        settled, live, at this group's outer step or later and at most one round (the one it may have on the wire)
        behind its claim, and of a state this group has not refused. Read at most every `CORROBORATE_S` (the read
        and the pings are the network's)."""
        step, checked_at, verdict = self.corroborated
        if step == mine.outer_step and mine.at - checked_at < CORROBORATE_S:
            return verdict

        def shown(progress: Progress) -> bool:
            return progress.settled and progress.outer_step >= mine.outer_step and not self.refused(progress) and any(
                claim.owner in ("", progress.owner) and progress.outer_step >= claim.outer_step - 1
                for claim in claims.get(progress.world_rank, ())
            )  # fmt: skip  (a claim without an owner: the in-memory swarm's, which signs nothing)

        candidates = sorted(filter(shown, self.swarm.records()), key=lambda r: r.outer_step)
        verdict = any(self.swarm.alive(r.peers[0]) for r in candidates[:CORROBORATE_PINGS])  # the nearest first
        self.corroborated = (mine.outer_step, mine.at, verdict)
        return verdict

    # ---------------------------------------------------------------- rounds

    def round_index(self, step: int, outer_step: int) -> int:
        return outer_step + 1

    def last_round(self, step: int, index: int) -> bool:
        return index >= self.final_outer_step

    def in_round(self, step: int, outer_step: int) -> bool:
        return False  # the round after a loaded state is the swarm's next one, not the one under way

    def next_boundary(self, outer_step: int) -> int | None:
        return None

    def weight(self, tokens: int) -> float:
        return float(tokens)

    def new_round(self, outer_step: int) -> None:
        self.fraction, self.round_started = 0.0, self.clock()
        self.stepped_at, self.due_at, self.undue, self.arrivals = None, None, None, {}
        if self.group.is_main:  # tell the others at once: they must not count last round's tokens any longer
            self.swarm.publish_tokens(RoundTokens(self.world_rank, outer_step, 0, self.rate, self.round_started,
                                                  step_s=self.step_s))  # fmt: skip
            self.published_at = self.round_started

    def position(self, step: int, outer_step: int) -> int:
        if outer_step >= self.final_outer_step:
            return self.max_steps
        return min(int((outer_step + self.fraction) * self.steps_per_round), self.max_steps - 1)

    def summary(self, tokens: int) -> dict[str, Any]:
        return {"swarm_tokens": int(self.estimate), "held_s": round(self.held_s, 3)}

    def budget(self) -> tuple[int, int]:
        return round(self.target_tokens), self.final_outer_step

    def adopt(self, budget: tuple[int, int]) -> None:
        """The swarm's N and run length in rounds, from the group that set them (of another batch, or length in
        inner steps): this group's LR schedule and its end follow the swarm's rounds, `max_steps` of its own
        steps over them."""
        self.target_tokens, self.final_outer_step = float(budget[0]), max(1, budget[1])
        self.steps_per_round = self.max_steps / self.final_outer_step
        self.earliest = budget_earliest(self.target_tokens, self.galaxy_size)


def check_overlap(hv: HvConfig, tokens_per_step: int) -> None:
    """Under --hv.target-tokens N, refuse an overlap that would not land before the next round of an average
    group: that is N ÷ (F × galaxy size × tokens per inner step) inner steps after it (a faster group makes
    more, a slower one fewer; a round that comes due first lands the one in flight at once). Under --hv.pace
    tokens, N follows H: the config checked it against H ÷ F."""
    if hv.budget_given() is None or not hv.overlap_steps:
        return
    steps = hv.budget_given() / (hv.fragments * hv.galaxy_size * max(tokens_per_step, 1))
    if hv.overlap_steps >= steps:
        raise FieldError(
            f"{{overlap_steps}} {hv.overlap_steps} must be smaller than the inner steps between two rounds: "
            f"{{target_tokens}} {hv.target_tokens} / ({{fragments}} {hv.fragments} x {{galaxy_size}} "
            f"{hv.galaxy_size} x {tokens_per_step} tokens per inner step) = {steps:.1f}"
        )

"""Where a group's inner steps stand against its outer parameters: since when each part of its model holds steps no
round has averaged yet, and which steps were thrown away.

The outer loop (``diloco.outer.diloco``) keeps one `Ledger` per rank (every rank of a group keeps the same one). A
round's weight counts the tokens since its fragment was last reset to the outer values (`fragment_tokens`); the pace
counts them since the swarm's round began for this group (`pace_tokens`: after a load that kept the group's steps,
from the load). Steps are discarded when the model is reset without them: a state loaded under ``--hv.late-work
drop``, a round this group applied alone and then replaced by another group's state, a last round that applied
nothing. Each discard is counted for the run's summary and reported once, in the next outer row (`row_fields`).

Plain Python; no torch, no network.
"""

from __future__ import annotations

from typing import Any


class Ledger:
    """A group's inner steps against its outer state.

    :param fragments: F, the fragments a round may average one at a time (1: the whole model).
    :param tokens_per_step: tokens of one inner step of this group (all ranks).
    """

    def __init__(self, fragments: int, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.round_start = 0  # the inner step at which this group's current round began
        self.pace_start = 0  # ... as its pace counts it: a group that kept its late steps counts from the load on
        # per fragment, the inner step its values were last reset to the outer ones (a round's weight counts the
        # tokens from there: a fragment's pseudo-gradient holds every inner step since, over F rounds)
        self.fragment_start = [0] * fragments
        self.discarded_steps = self.discarded_tokens = 0  # thrown away in this run (since its start or resume)
        self.alone_steps = 0  # inner steps of the last round this group applied alone (lost if it loads a state)
        self.unlogged: dict[str, int] = {}  # what the next outer row reports: discarded and carried steps

    def pace_tokens(self, step: int) -> int:
        """Tokens this group trained since its last round started, as its pace counts them."""
        return (step - self.pace_start) * self.tokens_per_step

    def fragment_tokens(self, step: int, fragment: int | None) -> int:
        """Tokens since `fragment` (None: the whole model) was last reset to the outer values."""
        return (step - self.fragment_start[fragment or 0]) * self.tokens_per_step

    def trained(self, step: int) -> int:
        """Inner steps the model holds beyond its outer parameters at inner step `step`: since its fragments were
        last reset (their mean with fragments, where each was reset at its own round)."""
        starts = self.fragment_start
        return max(0, round(sum(step - start for start in starts) / len(starts)))

    def new_round(self, step: int, fragment: int | None = None) -> None:
        """The outer parameters changed at inner step `step`: the model (or the one `fragment` a round averaged) was
        reset to them, and the next round starts."""
        self.round_start = self.pace_start = step
        self.reset_fragments(step, fragment)

    def reset_fragments(self, step: int, fragment: int | None) -> None:
        for f in range(len(self.fragment_start)) if fragment is None else (fragment,):
            self.fragment_start[f] = step

    def kept(self, steps: int, shift: int, step: int) -> None:
        """A load kept the model's `steps` inner steps; the group's inner step count moved by `shift` to `step`
        (every start moves with it, so the tokens since each stay), and its pace counts from here."""
        self.round_start += shift
        self.fragment_start = [start + shift for start in self.fragment_start]
        self.pace_start = step
        if steps:
            self.unlogged["carried_steps"] = self.unlogged.get("carried_steps", 0) + steps

    def discard(self, steps: int) -> bool:
        """`steps` inner steps were thrown away; returns whether there were any."""
        if steps <= 0:
            return False
        tokens = steps * self.tokens_per_step
        self.discarded_steps += steps
        self.discarded_tokens += tokens
        for name, value in (("discarded_steps", steps), ("discarded_tokens", tokens)):
            self.unlogged[name] = self.unlogged.get(name, 0) + value
        return True

    def row_fields(self) -> dict[str, Any]:
        """The fields of the next outer row (every row says what was discarded, 0 when nothing); resets them."""
        fields = {"discarded_steps": 0, "discarded_tokens": 0} | self.unlogged
        self.unlogged = {}
        return fields

    def state_dict(self) -> dict[str, Any]:
        return {"round_start": self.round_start, "fragment_start": list(self.fragment_start)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's starts; one from before token budgets has none (0), one from before fragments had their
        own starts (or of another F) takes the round's start for each."""
        self.round_start = self.pace_start = state.get("round_start", 0)
        starts = state.get("fragment_start")
        fits = starts is not None and len(starts) == len(self.fragment_start)
        self.fragment_start = list(starts) if fits else [self.round_start] * len(self.fragment_start)

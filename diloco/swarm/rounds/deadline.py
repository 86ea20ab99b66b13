"""How long a round of whole groups may take (``--hv.averaging-timeout``).

A number is today's fixed guess: every round's deadline, and the wait wherever one fixed number is needed. ``auto``
(the default) lets the deadline follow the rounds: a group's rank 0 measures each round it ran (from the group
formed to the result) and gives the next one ``MARGIN`` times the slowest of the last ``WINDOW``, at least
``FLOOR_S`` and at most ``AUTO_CAP`` times its first deadline. Before any round was measured that first deadline
is ``DEFAULT_S`` plus the round's bytes at ``transfer.MIN_RATE``, so a big model's first round does not time out.
A failed round asks for ``FAILURE_FACTOR`` times its own deadline: a link slower than the deadline assumed gets a
longer one, and a failure never shortens the next round's.

The round's deadline is ``tcp.ROUND_STEPS`` of its per-step timeout (``GroupRounds`` hands that to ``tcp.Round``);
rank 0 decides it and its group's other ranks learn it with the round, so a group's ranks use the same one."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import NamedTuple

from diloco.swarm.rounds.tcp import ROUND_STEPS
from diloco.swarm.rounds.transfer import MIN_RATE

DEFAULT_S = 60.0  # auto, where one fixed number is needed (joining, settling, matchmaking): the old default
# the slowest recent round times this: with ROUND_STEPS = 4 a single step (a groupmate's next part, a reply) may take
# as long as that whole round did, and the round four times as long: a link at half its rate, a round of a bigger
# fragment, a groupmate's pause still fit, while a dead groupmate costs about one round's time, not a minute
MARGIN = 4.0
# rounds the deadline remembers: one slow round (a congested moment, a collection pause) keeps it up for a few more,
# and with --hv.fragments up to 5 the slowest fragment's round is always among them
WINDOW = 5
# the shortest deadline of a round, 5 s per step: a step also covers the lag of the groups entering the round (each
# learns of it from its matchmaking, then its own ranks from its rank 0); ``start.IDLE_WAIT_S`` and a connection's
# 5 s are what the code already allows for that, however fast the last rounds were
FLOOR_S = 4 * 5.0
AUTO_CAP = 4.0  # auto's longest deadline, in first deadlines: a link four times slower than MIN_RATE still fits
FAILURE_FACTOR = 2.0  # a failed round asks for this times its own deadline (a timeout: it needed longer)
VALUE_BYTES = 4  # a value on the wire, at most (float32, --hv.compression none)


class Measured(NamedTuple):
    """One round as its group's rank 0 ran it: seconds from the group formed to the result, the deadline it had,
    and whether its part completed."""

    seconds: float
    deadline: float
    ok: bool


def fixed_timeout(setting: float | str) -> float:
    """The one number ``--hv.averaging-timeout`` `setting` stands for where a fixed wait is needed (a joining
    group's state download, the final settling, the rendezvous, matchmaking's gather, a listener's registration):
    ``DEFAULT_S`` for auto, else the number."""
    return DEFAULT_S if setting == "auto" else float(setting)


def first_deadline(setting: float | str, model_bytes: int) -> float:
    """Seconds a round may take before any was measured: the number given, or for auto ``DEFAULT_S`` plus
    `model_bytes` (the round's values at ``VALUE_BYTES`` each) at ``MIN_RATE``."""
    return DEFAULT_S + model_bytes / MIN_RATE if setting == "auto" else float(setting)


def round_deadline(setting: float | str, model_bytes: int, recent: Sequence[Measured]) -> float:
    """Seconds the next round may take in all (its per-step timeout: this / ``ROUND_STEPS``) under
    ``--hv.averaging-timeout`` `setting`, for a round of `model_bytes`, after the `recent` rounds (oldest first; only
    the last ``WINDOW`` count). A number: that number, whatever the rounds did."""
    first = first_deadline(setting, model_bytes)
    if setting != "auto" or not recent:
        return first
    asks = [FAILURE_FACTOR * r.deadline if not r.ok else MARGIN * r.seconds for r in recent[-WINDOW:]]
    return min(max(max(asks), FLOOR_S), AUTO_CAP * first)


class Deadlines:
    """A group's rank 0's record of its recent rounds, and the deadline of its next one (``round_deadline``)."""

    def __init__(self, setting: float | str):
        if setting != "auto" and not float(setting) > 0:
            raise ValueError(f"--hv.averaging-timeout must be auto or a positive number of seconds, not {setting!r}")
        self.setting = setting
        self.recent: collections.deque[Measured] = collections.deque(maxlen=WINDOW)

    def step_timeout(self, model_bytes: int) -> float:
        """Seconds any single step of the next round may take, for a round of `model_bytes`."""
        return round_deadline(self.setting, model_bytes, list(self.recent)) / ROUND_STEPS

    def record(self, seconds: float, deadline: float, ok: bool) -> None:
        """A round ran: `seconds` from the group formed to the result, under `deadline`; `ok`: it completed."""
        self.recent.append(Measured(seconds, deadline, ok))


def round_bytes(model_shapes: Sequence[Sequence[int]]) -> int:
    """The bytes of a round over parameters of `model_shapes` (every rank of every group computes the same)."""
    total = 0
    for shape in model_shapes:
        numel = 1
        for dim in shape:
            numel *= int(dim)
        total += numel
    return VALUE_BYTES * total

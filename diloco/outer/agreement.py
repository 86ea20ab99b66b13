"""What the groups of a run must agree on, and the one line a group leaves with when it does not.

Rank 0 of a joining group compares its model's fingerprint (``diloco.swarm.records.fingerprint``) with the status
records (``diloco.swarm.records.status``) of the groups already there, and in a keyed swarm leaves with one line
naming both sides when they differ: only members can publish there, so a second model under one run id is an
operator's mistake, and training on alone would hide it. The same goes for what else the groups of a run must
share: the outer setting (wire format included) and the schedule (when rounds are due and the last inner step). In
an open swarm anyone can publish a status record, so the same line is a warning and the group trains on
(``DiLoCo.claim_world_rank``): a stranger's record must not stop groups.

Plain Python over status records; no hivemind.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from diloco.errors import FieldError
from diloco.outer.beacon import WIRE
from diloco.swarm.records.fingerprint import ModelId
from diloco.swarm.records.status import LEFT, Status

BUDGET_RATIO = 16  # a budget taken from another group is within this factor of the group's own, in N and in rounds


def schedule(final_step: int | None, local_steps: int, budget: tuple[int, int] | None, fragments: int = 1,
             overlap_steps: int = 0) -> str:
    """What a group's status record says of its schedule, for the check below: when its rounds are due and when
    the run ends (every H inner steps until its last inner step, or under a token budget every N tokens of the
    swarm for R rounds: `budget` = (N, R), which groups of any batch and length share), its fragments and
    overlapped steps. Groups that differ in any of these would not go to the same rounds, or not end with the same
    outer step, so they would not end on one model."""
    if budget is not None:
        parts = [f"{budget[1]} rounds of {budget[0]} tokens"]
    else:
        parts = [f"{final_step} steps" if final_step is not None else "no last step", f"H {local_steps}"]
    if fragments > 1:
        parts.append(f"{fragments} fragments")
    if overlap_steps:
        parts.append(f"{overlap_steps} overlapped steps")
    return ", ".join(parts)


def wire_format(compression: str, density: float, bits: int, rule: str, decay: float) -> str:
    """How a group's rounds travel, as its status record says it: ``--hv.compression``, and for sparse rounds the
    density, bits, rule and error decay (the codec and the outer step every group of the run must share: a round
    between two formats fails at every connection's hello)."""
    return compression if compression != "sparse" else f"sparse/{density:g}/{bits}/{rule}/{decay:g}"


def same_outer(theirs: str, ours: str) -> bool:
    """Whether two status records' outer settings (``beacon.outer_setting``) agree: equal, or one says nothing (an
    older trainer), or one says no wire format (a trainer from before it was said) and the rest is equal."""
    if not theirs or not ours or theirs == ours:
        return True
    (lr, rule, wire), (our_lr, our_rule, our_wire) = _setting(theirs), _setting(ours)
    return (lr, rule) == (our_lr, our_rule) and (not wire or not our_wire)


def rival_model(mine: Status, records: Iterable[Status], alive: Callable[[str], bool]) -> Status | None:
    """The status record of a live group of the run that trains another model, or runs a trainer from before
    fingerprints (its record has no model: it uses other keys and would never meet this group), or takes outer steps
    with another lr, momentum or lr warm-up (the same averaged pseudo-gradient would then leave the groups on
    different outer parameters) or another ``--hv.aggregation`` (a reducer with the mean
    would undo the others' robustness on its spans) or another schedule (``schedule``), and was there first; None
    if there is none.

    A group past joining was there first; of two groups joining at the same moment the one whose record is older
    stays (then the lower world rank), so exactly one of them leaves. Groups that left are not compared; a record
    without a peer id (an older trainer) counts as live until it expires.
    """
    if not mine.model:
        return None
    for record in records:
        # (the transport is a preference: groups of any share a run, each pair of ranks picks its own path)
        same = record.model == mine.model and same_outer(record.outer, mine.outer)
        same = same and (not mine.schedule or record.schedule in ("", mine.schedule))
        if record.world_rank == mine.world_rank or same or record.state in LEFT:
            continue
        first = record.state != "joining" or (record.heard_at, record.world_rank) < (mine.heard_at, mine.world_rank)
        if first and (not record.peer or alive(record.peer)):
            return record
    return None


def mismatch_error(
    other: Status, mine: ModelId, outer: str = "", schedule: str = "", batch: str = ""
) -> FieldError:
    """The one line a group leaves with (in an open swarm: warns with) when `rival_model` found `other` (naming
    ``run_id``, the field of the schedule that differs, ``outer_lr``, ``aggregation`` or ``compression``). A schedule
    that differs comes first: what ``auto`` picks for the outer step follows it, so it is the flag that really
    differs. `batch`: this group's ``<total batch size>x<sequence length>`` (``Status.batch``)."""
    if not other.model:
        return FieldError(
            f"{{run_id}}: worker group {other.world_rank} runs a diloco from before model fingerprints, which cannot "
            "average with this one; run one diloco version in every group of a run, or give this one another run id"
        )
    if other.model == mine.fingerprint:
        if same_outer(other.outer, outer) or (schedule and other.schedule not in ("", schedule)):
            return _schedule_error(other, schedule, batch)
        (theirs, their_rule, their_wire), (ours, our_rule, our_wire) = _setting(other.outer), _setting(outer)
        if (theirs, their_rule) == (ours, our_rule):
            return FieldError(
                f"{{compression}} {_said(our_wire)}: worker group {other.world_rank} (peer {other.peer}) sends its "
                f"rounds as {_said(their_wire)}; the groups of a run must use one wire format: give every group the "
                "same --hv.compression (and with sparse, --hv.sparse-density, --hv.sparse-bits, --hv.sparse-rule "
                "and --hv.error-decay): a round between two formats fails"
            )
        if theirs == ours:
            return FieldError(
                f"{{aggregation}} {our_rule}: worker group {other.world_rank} (peer {other.peer}) combines "
                f"pseudo-gradients with {their_rule}; the groups of a run must use one --hv.aggregation (a reducer "
                "with another rule decides the spans it reduces)"
            )
        return FieldError(
            f"{{outer_lr}}: worker group {other.world_rank} (peer {other.peer}) takes outer steps with lr/momentum "
            f"and warm-up {theirs}, this group with {ours}; the groups of a run must use one outer setting: "
            "give every group the same --hv.outer-lr, --hv.outer-momentum and --hv.outer-lr-warmup (auto picks "
            "them by H, galaxy size and --warmup-steps)"
        )
    theirs = ModelId(other.model, other.parameters or 0)
    return FieldError(
        f"{{run_id}}: worker group {other.world_rank} (peer {other.peer}) trains another model ({theirs}) than "
        f"this group ({mine}); the groups of a run must train the same model: give this one the same model or "
        "another run id"
    )


def _schedule_error(other: Status, schedule: str, batch: str = "") -> FieldError:
    """`other` runs another `schedule`: the line names the first field in which the two differ."""
    theirs, ours = _schedule_parts(other.schedule), _schedule_parts(schedule)
    if ("local_steps" in theirs) != ("local_steps" in ours):
        return FieldError(
            f"{{pace}}: worker group {other.world_rank} (peer {other.peer}) runs {other.schedule}, this group "
            f"{schedule}; the groups of a run must pace their rounds alike: give every group the same --hv.pace "
            "(and --hv.target-tokens, if any)"
        )
    fields = ("/max_steps", "local_steps", "target_tokens", "fragments", "overlap_steps")
    if "target_tokens" in ours:  # a budget's length in rounds follows its N: the N is the flag that differs
        fields = ("target_tokens", "/max_steps", "fragments", "overlap_steps")
    field = next((f for f in fields if theirs.get(f) != ours.get(f)), "local_steps")
    return FieldError(
        f"{{{field}}}: worker group {other.world_rank} (peer {other.peer}) runs {other.schedule}, this group "
        f"{schedule}; the groups of a run must share one schedule to go to the same rounds and end on one model: "
        "give every group the same --max-steps (or --epochs), --hv.local-steps or --hv.target-tokens, "
        "--hv.fragments and --hv.overlap-steps"
    )


def budget_of(schedule: str) -> tuple[int, int] | None:
    """A token budget's (tokens per round, rounds) from a status record's `schedule`; None under fixed H."""
    found = re.match(r"(\d{1,18}) rounds of (\d{1,18}) tokens(, |$)", schedule)
    return (int(found[2]), int(found[1])) if found else None


def with_budget(schedule: str, budget: tuple[int, int]) -> str:
    """`schedule` (of a token budget) with the swarm's `budget` (tokens per round, rounds) instead of its own."""
    return re.sub(r"^\d+ rounds of \d+ tokens", f"{budget[1]} rounds of {budget[0]} tokens", schedule)


def announced_budget(mine: Status, records: Iterable[Status], alive: Callable[[str], bool]) -> tuple[int, int] | None:
    """The token budget a joining group adopts: that of the live group of the same model, outer setting,
    fragments and overlap that set it first (past joining first, then the oldest record, then the lowest world
    rank, as `rival_model` orders them); None when no such group has one, or this group is first."""
    ours = _schedule_parts(mine.schedule)
    rest = {k: v for k, v in ours.items() if k in ("fragments", "overlap_steps")}
    candidates = []
    for record in records:
        theirs = _schedule_parts(record.schedule)
        alike = record.model == mine.model
        alike = alike and bool(record.outer) == bool(mine.outer) and same_outer(record.outer, mine.outer)
        alike = alike and {k: v for k, v in theirs.items() if k in ("fragments", "overlap_steps")} == rest
        budget = budget_of(record.schedule)
        if record.world_rank == mine.world_rank or record.state in LEFT or not alike or budget is None:
            continue
        if record.peer and alive(record.peer):  # (a record alone, which anyone may write, sets no budget)
            candidates.append(((record.state == "joining", record.heard_at, record.world_rank), budget))
    me = (mine.state == "joining", mine.heard_at, mine.world_rank)
    first = min(candidates, default=None)
    return first[1] if first is not None and first[0] < me else None


def budget_to_adopt(ours: tuple[int, int], follows_h: bool, mine: Status, records: Iterable[Status],
                    alive: Callable[[str], bool]) -> tuple[int, int] | None:  # fmt: skip
    """The swarm's token budget (tokens per round, rounds) a joining group with budget `ours` takes, from the group
    that set it first (`announced_budget`): when its own N follows H (`follows_h`: N is then that group's, whatever
    this group's batch) or is the same N (its length in rounds is then the swarm's, whatever this group's
    --max-steps). None: nothing to take (it would leave over another given N: `rival_model`)."""
    theirs = announced_budget(mine, records, alive)
    if theirs is None or theirs == ours or not (follows_h or theirs[0] == ours[0]):
        return None
    if not all(1 / BUDGET_RATIO <= t / o <= BUDGET_RATIO for t, o in zip(theirs, ours)):
        return None  # not one run's budget: this group keeps its own, and leaves (or warns) over the difference
    return theirs


def _schedule_parts(text: str) -> dict[str, str]:
    """A `schedule` line's parts by the field that sets each."""
    parts = {}
    for i, part in enumerate(text.split(", ")):
        if found := re.fullmatch(r"(\d+) rounds of (\d+) tokens", part):
            parts["/max_steps"], parts["target_tokens"] = f"{found[1]} rounds", f"{found[2]} tokens"
        elif i == 0:
            parts["/max_steps"] = part
        elif part.startswith("H "):
            parts["local_steps"] = part
        else:
            parts["fragments" if part.endswith("fragments") else "overlap_steps"] = part
    return parts


def _setting(outer: str) -> tuple[str, str, str]:
    """A status record's outer setting (``beacon.outer_setting``) as (lr/momentum wN, aggregation, wire format; ""
    when not said)."""
    words = outer.split()
    wire = [w[len(WIRE) :] for w in words[2:] if w.startswith(WIRE)]
    rule = " ".join(w for w in words[2:] if not w.startswith(WIRE))
    return " ".join(words[:2]), rule or "mean", wire[0] if wire else ""


def _said(wire: str) -> str:
    """A wire format (``wire_format``) as the flags give it (a stranger's record's: printable, and short)."""
    wire = "".join(c for c in wire if c.isprintable())[:80]
    parts = wire.split("/")
    if parts[0] != "sparse" or len(parts) != 5:
        return wire
    _, density, bits, rule, decay = parts
    return f"sparse (density {density}, {bits} bits, {rule}, error decay {decay})"

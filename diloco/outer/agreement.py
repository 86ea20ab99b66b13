"""What the groups of a run must agree on, and the one line a group leaves with when it does not.

Rank 0 of a joining group compares its model's fingerprint (``diloco.swarm.records.fingerprint``) with the status
records (``diloco.swarm.records.status``) of the groups already there, and in a keyed swarm leaves with one line
naming both sides when they differ: only members can publish there, so a second model under one run id is an
operator's mistake, and training on alone would hide it. The same goes for what else the groups of a run must
share: the transport, the outer setting and the schedule (when rounds are due and the last inner step). In an open
swarm anyone can publish a status record, so the same line is a warning and the group trains on
(``DiLoCo.claim_world_rank``): a stranger's record must not stop groups.

Plain Python over status records; no hivemind.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from diloco.errors import FieldError
from diloco.swarm.records.fingerprint import ModelId
from diloco.swarm.records.status import LEFT, Status


def schedule(final_step: int | None, local_steps: int, target_tokens: int | None, tokens_per_step: int,
             fragments: int = 1, overlap_steps: int = 0) -> str:
    """What a group's status record says of its schedule, for the check below: its last inner step, when its
    rounds are due (every H inner steps, or under a token budget every N tokens of the swarm, which counts this
    group's steps by their tokens), its fragments and overlapped steps. Groups that differ in any of these would
    not go to the same rounds, or not end with the same outer step, so they would not end on one model."""
    parts = [f"{final_step} steps" if final_step is not None else "no last step"]
    parts.append(f"{target_tokens} tokens per round of {tokens_per_step}-token steps" if target_tokens
                 else f"H {local_steps}")  # fmt: skip
    if fragments > 1:
        parts.append(f"{fragments} fragments")
    if overlap_steps:
        parts.append(f"{overlap_steps} overlapped steps")
    return ", ".join(parts)


def rival_model(mine: Status, records: Iterable[Status], alive: Callable[[str], bool]) -> Status | None:
    """The status record of a live group of the run that trains another model, or runs a trainer from before
    fingerprints (its record has no model: it uses other keys and would never meet this group), or averages over
    another ``--hv.transport`` (the two matchmake under different keys and reach ranks differently: they never
    meet), or takes outer steps with another lr, momentum or lr warm-up (the same averaged pseudo-gradient would
    then leave the groups on different outer parameters) or another ``--hv.aggregation`` (a reducer with the mean
    would undo the others' robustness on its spans) or another schedule (``schedule``), and was there first; None
    if there is none.

    A group past joining was there first; of two groups joining at the same moment the one whose record is older
    stays (then the lower world rank), so exactly one of them leaves. Groups that left are not compared; a record
    without a peer id (an older trainer) counts as live until it expires.
    """
    if not mine.model:
        return None
    for record in records:
        same = record.model == mine.model and (not mine.transport or record.transport in ("", mine.transport))
        same = same and (not mine.outer or record.outer in ("", mine.outer))
        same = same and (not mine.schedule or record.schedule in ("", mine.schedule))
        if record.world_rank == mine.world_rank or same or record.state in LEFT:
            continue
        first = record.state != "joining" or (record.heard_at, record.world_rank) < (mine.heard_at, mine.world_rank)
        if first and (not record.peer or alive(record.peer)):
            return record
    return None


def mismatch_error(
    other: Status, mine: ModelId, transport: str = "", outer: str = "", schedule: str = "", batch: str = ""
) -> FieldError:
    """The one line a group leaves with (in an open swarm: warns with) when `rival_model` found `other` (naming
    ``run_id``, ``transport``, the field of the schedule that differs, ``outer_lr`` or ``aggregation``). A schedule
    that differs comes first: what ``auto`` picks for the outer step follows it, so it is the flag that really
    differs. `batch`: this group's ``<total batch size>x<sequence length>`` (``Status.batch``)."""
    if not other.model:
        return FieldError(
            f"{{run_id}}: worker group {other.world_rank} runs a diloco from before model fingerprints, which cannot "
            "average with this one; run one diloco version in every group of a run, or give this one another run id"
        )
    if other.model == mine.fingerprint and other.transport in ("", transport):
        if other.outer in ("", outer) or (schedule and other.schedule not in ("", schedule)):
            return _schedule_error(other, schedule, batch)
        (theirs, their_rule), (ours, our_rule) = _setting(other.outer), _setting(outer)
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
    if other.model == mine.fingerprint:
        return FieldError(
            f"{{transport}} {transport}: worker group {other.world_rank} (peer {other.peer}) averages over "
            f"--hv.transport {other.transport}; the groups of a run must use one transport (a tcp group and a p2pd "
            "group never meet)"
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
    fields = ("/max_steps", "local_steps", "target_tokens", "fragments", "overlap_steps")
    field = next((f for f in fields if theirs.get(f) != ours.get(f)), "local_steps")
    their_budget, our_budget = _budget(theirs.get(field, "")), _budget(ours.get(field, ""))
    if field == "target_tokens" and their_budget and our_budget and their_budget[0] == our_budget[0]:
        return _batch_error(other, their_budget[1], our_budget[1], batch)
    return FieldError(
        f"{{{field}}}: worker group {other.world_rank} (peer {other.peer}) runs {other.schedule}, this group "
        f"{schedule}; the groups of a run must share one schedule to go to the same rounds and end on one model: "
        "give every group the same --max-steps (or --epochs), --hv.local-steps or --hv.target-tokens (with a "
        "token budget also --total-batch-size and --seq-length), --hv.fragments and --hv.overlap-steps"
    )


def _batch_error(other: Status, theirs: int, ours: int, batch: str) -> FieldError:
    """Under one token budget `other` trains `theirs` tokens per inner step, this group `ours`: the line names the
    flag that makes the difference (``--total-batch-size`` or ``--seq-length``, from the records' ``batch``; both
    where the other's record has none)."""
    their_shape, our_shape = _batch_shape(other.batch), _batch_shape(batch)
    if their_shape and our_shape and their_shape[0] == our_shape[0]:
        field, flags = "/seq_length", "--seq-length"
    elif their_shape and our_shape:
        field, flags = "/total_batch_size", "--total-batch-size"
    else:
        field, flags = "/total_batch_size", "--total-batch-size and --seq-length"
    shown = [f" ({shape[0]} sequences of {shape[1]})" if shape else "" for shape in (their_shape, our_shape)]
    return FieldError(
        f"{{{field}}}: worker group {other.world_rank} (peer {other.peer}) trains {theirs} tokens per inner step"
        f"{shown[0]}, this group {ours}{shown[1]}; under --hv.target-tokens the groups of a run must train as many "
        f"tokens per inner step: give every group the same {flags}"
    )


def _budget(part: str) -> tuple[int, int] | None:
    """A schedule's token-budget part as (tokens per round, tokens per inner step); None if it is not one."""
    found = re.fullmatch(r"(\d+) tokens per round of (\d+)-token steps", part)
    return (int(found[1]), int(found[2])) if found else None


def _batch_shape(batch: str) -> tuple[int, int] | None:
    """``Status.batch`` as (total batch size, sequence length); None when empty or not of that form."""
    found = re.fullmatch(r"(\d+)x(\d+)", batch)
    return (int(found[1]), int(found[2])) if found else None


def _schedule_parts(text: str) -> dict[str, str]:
    """A `schedule` line's parts by the field that sets each."""
    parts = {}
    for i, part in enumerate(text.split(", ")):
        if i == 0:
            parts["/max_steps"] = part
        elif part.startswith("H "):
            parts["local_steps"] = part
        elif "per round" in part:
            parts["target_tokens"] = part
        else:
            parts["fragments" if part.endswith("fragments") else "overlap_steps"] = part
    return parts


def _setting(outer: str) -> tuple[str, str]:
    """A status record's outer setting (``DiLoCo.outer_setting``) as (lr/momentum wN, aggregation)."""
    words = outer.split()
    return " ".join(words[:2]), " ".join(words[2:]) or "mean"

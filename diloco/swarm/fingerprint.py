"""A model's fingerprint, and the check that keeps groups of different models (or settings) apart.

Two worker groups can average only if they train the same model: the same parameter names, shapes and dtypes, in
the same order. The fingerprint hashes exactly that (not the values), so it is the same in every group however it
is sharded, and it goes into the matchmaking and progress keys: groups of different models never meet, so no byte
of one reaches the other. Rank 0 of a joining group also compares it with the status records (``diloco.swarm.
status``) of the groups already there, and leaves with one line naming both sides when they differ: a second model
under one run id is a mistake, and training on alone would hide it. The same goes for what else the groups of a
run must share: the transport, the outer setting and the schedule (when rounds are due and the last inner step).

Plain Python over torch tensors and status records; no hivemind.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from diloco.config import FieldError
from diloco.swarm.status import LEFT, Status

FINGERPRINT_CHARS = 12  # hex characters: enough to tell models apart, short enough for a DHT key


@dataclass(frozen=True)
class ModelId:
    """What a group tells the others about its model: the fingerprint and, for people, the parameter count."""

    fingerprint: str
    parameters: int

    def __str__(self) -> str:
        return f"{self.parameters:,} parameters, fingerprint {self.fingerprint}"


def model_id(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> ModelId:
    """The fingerprint of a model's parameters (an unwrapped module's ``named_parameters()``: a sharded parameter
    counts with its full shape)."""
    digest, count = hashlib.sha256(), 0
    for name, parameter in named_parameters:
        digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype}\n".encode())
        count += parameter.numel()
    return ModelId(digest.hexdigest()[:FINGERPRINT_CHARS], count)


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
    other: Status, mine: ModelId, transport: str = "", outer: str = "", schedule: str = ""
) -> FieldError:
    """The one line a group leaves with when `rival_model` found `other` (naming ``run_id``, ``transport``,
    ``outer_lr``, ``aggregation`` or the field of the schedule that differs)."""
    if not other.model:
        return FieldError(
            f"{{run_id}}: worker group {other.world_rank} runs a diloco from before model fingerprints, which cannot "
            "average with this one; run one diloco version in every group of a run, or give this one another run id"
        )
    if other.model == mine.fingerprint and other.transport in ("", transport):
        if other.outer in ("", outer):
            return _schedule_error(other, schedule)
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


def _schedule_error(other: Status, schedule: str) -> FieldError:
    """`other` runs another `schedule`: the line names the first field in which the two differ."""
    theirs, ours = _schedule_parts(other.schedule), _schedule_parts(schedule)
    fields = ("/max_steps", "local_steps", "target_tokens", "fragments", "overlap_steps")
    field = next((f for f in fields if theirs.get(f) != ours.get(f)), "local_steps")
    return FieldError(
        f"{{{field}}}: worker group {other.world_rank} (peer {other.peer}) runs {other.schedule}, this group "
        f"{schedule}; the groups of a run must share one schedule to go to the same rounds and end on one model: "
        "give every group the same --max-steps (or --epochs), --hv.local-steps or --hv.target-tokens (with a "
        "token budget also --total-batch-size and --seq-length), --hv.fragments and --hv.overlap-steps"
    )


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


def run_key(run_id: str, model: ModelId | None) -> str:
    """The stem of every DHT key that only groups of `model` share (matchmaking, progress); the status key stays
    the run's, so onlookers and the check above see every group."""
    return f"{run_id}-{model.fingerprint}" if model else run_id

"""A model's fingerprint, which keeps groups of different models apart.

Two worker groups can average only if they train the same model: the same parameter names, shapes and dtypes, in
the same order. The fingerprint hashes exactly that (not the values), so it is the same in every group however it
is sharded, and it goes into the matchmaking and progress keys (`run_key`): groups of different models never meet,
so no byte of one reaches the other. A joining group also compares it with the groups already there
(``diloco.outer.agreement``).

Plain Python over torch tensors; no hivemind.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

FINGERPRINT_CHARS = 12  # hex characters: enough to tell models apart, short enough for a DHT key
# The version of what groups exchange: records, announcements, the rounds' and downloads' wire formats and the state
# digest. It is part of `run_key`, so groups of different versions never meet (they could not average or load each
# other's states); raised whenever one of those formats changes.
PROTOCOL = 4  # 4: round-token records carry a group's step time (`budget.RoundTokens.step_s`)


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


def run_key(run_id: str, model: ModelId | None) -> str:
    """The stem of every DHT key that only groups of `model` and of this `PROTOCOL` share (matchmaking, progress,
    token records); the status key stays the run's, so onlookers and the check above see every group."""
    return f"{run_id}-{model.fingerprint}-p{PROTOCOL}" if model else f"{run_id}-p{PROTOCOL}"

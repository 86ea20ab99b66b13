"""Hostile worker groups for `diloco bench poison`: a group that trains like the others but, in every round, sends
a forged pseudo-gradient in place of its own, or announces a forged weight. Each attack passes the norm screen
(`diloco.swarm.rounds.screening`: under 100× the group's median), so only the aggregation rule and the weight cap
stand between it and the model.

- `scaled`: 50 × its own pseudo-gradient;
- `sign-flip`: minus its own pseudo-gradient;
- `noise`: Gaussian noise with the L2 norm of its own pseudo-gradient, tensor by tensor;
- `heavy`: minus its own pseudo-gradient, announced with a weight of 1e30, so that the round's result would be its
  part alone. Every member caps announced weights alike (`screening.capped_weights`: 16× the lower median; the
  in-memory swarm caps the weights it is handed the same way). Among 4 honest groups of weight 1 that is still
  16/20 of the weight, which the mean follows; the robust rules count no contribution above the median one
  (`diloco.swarm.rounds.aggregation.votes`).

A group that connects as other groups' ranks (to replace their contributions with its own) is refused at its hello
(`diloco.swarm.rounds.hello`: each rank signs with its own key); the in-memory swarm has no connections to try it on,
so that attack runs over real sockets, in the fault tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

SCALE = 50.0
HEAVY = 1e30  # the weight `heavy` announces
ATTACKS: dict[str, Callable[[torch.Tensor, torch.Generator], torch.Tensor]] = {
    "scaled": lambda t, _: SCALE * t,
    "sign-flip": lambda t, _: -t,
    "noise": lambda t, g: _noise_like(t, g),
    "heavy": lambda t, _: -t,
}
ANNOUNCED = {"heavy": HEAVY}  # the weight an attack announces (the others: their honest one)


def _noise_like(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
    return noise * (tensor.norm() / noise.norm().clamp_min(1e-30))


class Attacker:
    """A group's link to the in-memory swarm (`diloco.outer.memory.Member`) that forges what it sends; everything
    else (records, states) it does as an honest group."""

    def __init__(self, member: Any, attack: str, seed: int) -> None:
        if attack not in ATTACKS:
            raise ValueError(f"unknown attack {attack!r}")
        self.member, self.forge, self.announced = member, ATTACKS[attack], ANNOUNCED.get(attack)
        self.generator = torch.Generator().manual_seed(seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.member, name)

    def average(self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: Callable[[], bool],
                fragment: int | None = None, outer_step: int | None = None, last: bool = False) -> Any:  # fmt: skip
        for tensor in tensors:
            tensor.copy_(self.forge(tensor, self.generator))
        if self.announced is not None and weight > 0:  # (a group that joined mid-round adds nothing, attacker or not)
            weight = self.announced  # the swarm caps it, as every member of a round caps the announced weights
        return self.member.average(tensors, round_index, weight, stop, fragment, outer_step, last)

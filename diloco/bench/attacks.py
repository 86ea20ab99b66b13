"""Hostile worker groups for `diloco bench poison`: a group that trains like the others but, in every round, sends
a forged pseudo-gradient in place of its own. Each attack passes the norm screen (`diloco.swarm.rounds.screening`: under
100× the group's median), so only the aggregation rule stands between it and the model.

- `scaled`: 50 × its own pseudo-gradient;
- `sign-flip`: minus its own pseudo-gradient;
- `noise`: Gaussian noise with the L2 norm of its own pseudo-gradient, tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

SCALE = 50.0
ATTACKS: dict[str, Callable[[torch.Tensor, torch.Generator], torch.Tensor]] = {
    "scaled": lambda t, _: SCALE * t,
    "sign-flip": lambda t, _: -t,
    "noise": lambda t, g: _noise_like(t, g),
}


def _noise_like(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
    return noise * (tensor.norm() / noise.norm().clamp_min(1e-30))


class Attacker:
    """A group's link to the in-memory swarm (`diloco.outer.memory.Member`) that forges what it sends; everything
    else (records, states) it does as an honest group."""

    def __init__(self, member: Any, attack: str, seed: int) -> None:
        if attack not in ATTACKS:
            raise ValueError(f"unknown attack {attack!r}")
        self.member, self.forge = member, ATTACKS[attack]
        self.generator = torch.Generator().manual_seed(seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.member, name)

    def average(self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: Callable[[], bool],
                fragment: int | None = None, outer_step: int | None = None) -> Any:  # fmt: skip
        for tensor in tensors:
            tensor.copy_(self.forge(tensor, self.generator))
        return self.member.average(tensors, round_index, weight, stop, fragment, outer_step)

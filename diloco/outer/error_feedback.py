"""Error feedback for sparse rounds (SparseLoCo, arXiv 2508.15706): what a rank's rounds did not carry of its
pseudo-gradients is added to its next ones.

Per rank and its shard, an error buffer e (float32, on the CPU, beside the outer parameters). At each round:

    x = decay · e + Δ            (Δ: this round's pseudo-gradient)
    send x; the round carries C(x), its sparse image (the selected values, rounded)
    e = x − C(x)                 once the round averaged with others

With ``decay`` < 1 and no outer momentum (``--hv.sparse-rule sparseloco``, the paper's), the buffer stands in for the
outer momentum: the swarm steps by the mean of the C(x); with ``decay`` = 1 (``nesterov``) it only keeps what was
not sent, and the outer Nesterov step goes on as with dense rounds.

A round that fails leaves e as it was (its pseudo-gradient carries over into the next round's Δ); a round a group
applies alone carries all of x, so e becomes 0. A group that loads the swarm's state starts with e = 0: its buffer
belonged to parameters it no longer holds. The buffer is in the group's checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from diloco.outer.fragments import Runs

Image = Callable[[torch.Tensor, "int | None"], torch.Tensor]  # (values of a fragment, fragment) -> their C(values)


class ErrorFeedback:
    """One rank's error buffer over its flat shard.

    :param numel: values of the rank's flat shard.
    :param decay: how much of the buffer the next round adds (SparseLoCo: 0.95; 1: all of it).
    :param image: what a round carries of a fragment's values (``Swarm.image``).
    :param fragments: each fragment's runs of the flat shard (``OuterOptimizer.fragments``).
    """

    def __init__(self, numel: int, decay: float, image: Image, fragments: list[Runs]):
        self.error = torch.zeros(numel)
        self.decay, self.image, self.fragments = decay, image, fragments
        self._pending: dict[int | None, torch.Tensor] = {}  # fragment -> x − C(x) of the round on its way

    def _runs(self, fragment: int | None) -> Runs:
        return [(0, self.error.numel())] if fragment is None else self.fragments[fragment]

    @torch.no_grad()
    def fold(self, pseudo_gradient: torch.Tensor, fragment: int | None = None) -> torch.Tensor:
        """x = decay · e + Δ, in place in `pseudo_gradient` (a fragment's runs, concatenated); what the round will
        not carry of it waits for the round's outcome."""
        offset = 0
        for a, b in self._runs(fragment):
            pseudo_gradient[offset : offset + b - a].add_(self.error[a:b], alpha=self.decay)
            offset += b - a
        carried = self.image(pseudo_gradient, fragment)
        # x − C(x) in the image's own memory (no third copy of the shard); an exact wire carries all of x
        self._pending[fragment] = torch.zeros_like(carried) if carried is pseudo_gradient else carried.neg_().add_(
            pseudo_gradient)  # fmt: skip
        return pseudo_gradient

    def averaged(self, fragment: int | None = None) -> None:
        """The round averaged with other groups: e = x − C(x) (unchanged when this group sent nothing of its own)."""
        pending = self._pending.pop(fragment, None)
        if pending is not None:
            self._set(fragment, pending)

    def applied_alone(self, fragment: int | None = None) -> None:
        """The group applied all of x by itself: nothing is left to send."""
        if self._pending.pop(fragment, None) is not None:
            self._set(fragment, None)

    def failed(self, fragment: int | None = None) -> None:
        """Nothing of x was applied: e stays as it was (the inner steps carry over)."""
        self._pending.pop(fragment, None)

    def reset(self) -> None:
        """A loaded state: start over from zero."""
        self._pending.clear()
        self.error.zero_()

    def _set(self, fragment: int | None, values: torch.Tensor | None) -> None:
        offset = 0
        for a, b in self._runs(fragment):
            if values is None:
                self.error[a:b].zero_()
            else:
                self.error[a:b].copy_(values[offset : offset + b - a])
            offset += b - a

    def state_dict(self) -> dict[str, Any]:
        return {"error_feedback": self.error}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's buffer; none (a checkpoint of dense rounds, or of one group alone): zero."""
        if "error_feedback" in state:
            self.error.copy_(state["error_feedback"])
        else:
            self.error.zero_()


class NoFeedback:
    """Dense rounds: nothing is kept back."""

    def fold(self, pseudo_gradient: torch.Tensor, fragment: int | None = None) -> torch.Tensor:
        return pseudo_gradient

    def averaged(self, fragment: int | None = None) -> None: ...
    def applied_alone(self, fragment: int | None = None) -> None: ...
    def failed(self, fragment: int | None = None) -> None: ...
    def reset(self) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

"""The outer loop that wraps the inner training step. With galaxy size 1 it does nothing."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

log = logging.getLogger("diloco")


class OuterLoop(Protocol):
    """Called by the training loop after every inner step; owns whatever happens between worker groups."""

    def after_inner_step(self, step: int) -> dict[str, Any] | None:
        """Run the outer step when one is due; return its metrics row, or None."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def summary(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class NoOuter:
    """Galaxy size 1: plain torch.distributed training, no DHT, no averaging."""

    def after_inner_step(self, step: int) -> dict[str, Any] | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class RoundResult(Protocol):
    """What one averaging round reports (see swarm.RoundReport)."""

    num_peers: int  # worker groups in the round, this one included; 1 = averaged alone
    seconds: float
    bytes_sent: int
    bytes_received: int
    ok: bool  # False: the round failed and the tensors were left as they were


class Averager(Protocol):
    """Averages tensors in place with the same-indexed rank of whichever worker groups are ready."""

    def average(self, tensors: Sequence[torch.Tensor], round_index: int) -> RoundResult:
        """Only groups averaging the same `round_index` (the outer step) meet."""
        ...

    def shutdown(self) -> None: ...


class DiLoCo:
    """The DiLoCo outer step over this rank's shard of the model, in plain torch.

    Every `local_steps` inner steps: pseudo-gradient = outer parameters − current parameters (this rank's
    shard, flattened, float32 on CPU); averaged with the same rank of the other groups; an outer SGD step with
    Nesterov momentum on the outer parameters, which stay off the accelerator; the model's shard is reset to
    the new outer parameters. The inner optimizer and its state are not touched.

    :param shards: this rank's local parameter shards, in a fixed order (the same in every group).
    :param averager: carries the bytes; never imported here, so this module knows nothing of hivemind.
    :param local_steps: H, inner steps between outer steps.
    :param outer_lr: outer SGD learning rate (the paper: 0.7).
    :param outer_momentum: Nesterov momentum of the outer SGD (the paper: 0.9); 0 means plain SGD.
    :param group_sum: sums a float over the ranks of this group (for the global pseudo-gradient norm).
    :param group_sha: collective: params_sha256 of the whole model on rank 0, None elsewhere.
    """

    def __init__(
        self,
        shards: list[torch.Tensor],
        averager: Averager,
        *,
        local_steps: int,
        outer_lr: float,
        outer_momentum: float,
        group_sum: Callable[[float], float],
        group_sha: Callable[[], str | None],
    ) -> None:
        self.shards = [s for s in shards if s.numel() > 0]  # FSDP can leave a rank an empty shard
        self.averager, self.local_steps = averager, local_steps
        self.group_sum, self.group_sha = group_sum, group_sha
        self.outer = self._flat_shards()
        self.optimizer = torch.optim.SGD(
            [self.outer], lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0
        )
        self.outer_step = 0
        self.last_sha: str | None = None

    def _flat_shards(self) -> torch.Tensor:
        return torch.cat([s.detach().reshape(-1).to("cpu", torch.float32) for s in self.shards])

    def after_inner_step(self, step: int) -> dict[str, Any] | None:
        if step % self.local_steps:
            return None
        pseudo_gradient = self.outer - self._flat_shards()
        report = self.averager.average([pseudo_gradient], round_index=self.outer_step + 1)
        if not report.ok:
            log.warning("outer step %d: averaging failed, applying this group's own pseudo-gradient", self.outer_step + 1)
        elif report.num_peers == 1:
            log.warning("outer step %d: no peer was ready, averaged alone", self.outer_step + 1)
        num_peers = report.num_peers if report.ok else 1
        ranks = self.group_sum(1.0)
        if self.group_sum(float(num_peers)) != num_peers * ranks:  # each rank averages in its own round
            log.warning("outer step %d: the ranks of this group averaged with different peers", self.outer_step + 1)
        self.apply(pseudo_gradient)
        self.last_sha = self.group_sha()
        return {
            "step": step,
            "outer_step": self.outer_step,
            "num_peers": num_peers,
            "averaging_s": report.seconds,
            "bytes_sent": int(self.group_sum(float(report.bytes_sent))),  # all ranks of the group
            "bytes_received": int(self.group_sum(float(report.bytes_received))),
            "pseudo_grad_norm": math.sqrt(self.group_sum(float(pseudo_gradient.square().sum()))),
            "params_sha256": self.last_sha,
        }

    @torch.no_grad()
    def apply(self, pseudo_gradient: torch.Tensor) -> None:
        """Outer optimizer step with the averaged pseudo-gradient, then reset the shards to the outer params."""
        self.outer.grad = pseudo_gradient
        self.optimizer.step()
        self.outer.grad = None
        offset = 0
        for shard in self.shards:
            shard.copy_(self.outer[offset : offset + shard.numel()].view_as(shard))
            offset += shard.numel()
        self.outer_step += 1

    def state_dict(self) -> dict[str, Any]:
        return {"outer": self.outer.clone(), "optimizer": self.optimizer.state_dict(), "outer_step": self.outer_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # a checkpoint from a galaxy-size-1 run: start the outer loop from the loaded weights
            self.outer.copy_(self._flat_shards())
            return
        self.outer.copy_(state["outer"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.outer_step = state["outer_step"]

    def summary(self) -> dict[str, Any]:
        return {"outer_steps": self.outer_step}

    def close(self) -> None:
        self.averager.shutdown()

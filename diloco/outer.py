"""The DiLoCo outer step in plain torch, and the interface the training loop calls between inner steps.

Every H inner steps each rank of a worker group takes its shard of the model (FSDP leaves each rank its own),
flattens it to float32 on CPU, and computes the pseudo-gradient: outer parameters − current parameters. Once the
swarm averaged it (``diloco.membership``), an SGD step with Nesterov momentum moves the outer parameters, which
stay off the accelerator, and the model's shard is reset to them. The inner optimizer and its state are never
touched. Nothing here knows of other groups or of the network.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class OuterReport:
    """What the outer loop did at one inner step.

    :param step: the inner step to continue from: the step just taken, or the swarm's when this group was behind
        and loaded the swarm's state (the LR schedule follows it).
    :param row: the metrics row of the round (``outer_step``, ``num_peers``, ``params_sha256``, ...); None when
        there is nothing to log.
    """

    step: int
    row: dict[str, Any] | None = None


class OuterLoop(Protocol):
    """Called by the training loop around its inner steps; owns whatever happens between worker groups."""

    def join(self, step: int, load_from_peers: bool = True) -> OuterReport:
        """Before the first inner step: take this group's place among the others. A group that joins a running
        swarm continues at the swarm's inner step; the row is that of the round in progress it took part in."""
        ...

    def after_inner_step(self, step: int) -> OuterReport | None:
        """Run the outer step when one is due (its report always has a row); None when none was due."""
        ...

    def position(self, step: int) -> int:
        """Where the LR schedule and the end of the run stand after inner step `step`: `step` itself, or under a
        swarm-wide token budget the swarm's progress in inner steps of an average group (``diloco.pace``)."""
        ...

    def progress(self, row: dict[str, Any]) -> None:
        """After each metrics row of the inner loop (``step``, ``tokens_per_s``, ...): what the outer loop may
        tell others about this group's training; must return at once (no network waits)."""
        ...

    def finish(self) -> dict[str, Any] | None:
        """After the last inner step of a run that was not stopped: end with the swarm's final state; return a
        metrics row when that changed the model, else None."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def summary(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class NoOuter:
    """Galaxy size 1: plain torch.distributed training, no DHT, no averaging."""

    def join(self, step: int, load_from_peers: bool = True) -> OuterReport:
        return OuterReport(step)

    def after_inner_step(self, step: int) -> OuterReport | None:
        return None

    def position(self, step: int) -> int:
        return step

    def progress(self, row: dict[str, Any]) -> None:
        pass

    def finish(self) -> dict[str, Any] | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class OuterOptimizer:
    """This rank's shard of the outer parameters and their Nesterov SGD.

    Its methods hold `lock` (re-entrant: a caller may hold it across several calls): other groups download the
    state from a background thread while training goes on.

    :param shards: this rank's local parameter shards, in a fixed order (the same in every group); the outer
        parameters start as a float32 CPU copy of them.
    :param lr: outer SGD learning rate (the paper: 0.7).
    :param momentum: Nesterov momentum (the paper: 0.9); 0 means plain SGD.
    :param warmup: outer steps over which the lr rises linearly to `lr`: outer step s (from 0) takes
        lr · min(1, (s + 1) / warmup); 0 means none. It follows `steps`, which every group shares (a joiner
        loads it with the state), so groups stay bit-identical.
    """

    def __init__(self, shards: list[torch.Tensor], lr: float, momentum: float, warmup: int = 0) -> None:
        self.shards = [s for s in shards if s.numel() > 0]  # FSDP can leave a rank an empty shard
        self.outer = self.flat_shards()
        self.optimizer = torch.optim.SGD([self.outer], lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.lr, self.warmup = lr, warmup
        self.steps = 0  # outer steps applied to `outer`
        self.lock = threading.RLock()

    def flat_shards(self) -> torch.Tensor:
        """The model's current shard, flattened, as a new float32 CPU tensor."""
        return torch.cat([s.detach().reshape(-1).to("cpu", torch.float32) for s in self.shards])

    def pseudo_gradient(self) -> torch.Tensor:
        """Outer parameters − current parameters (a new tensor, averaged in place by the swarm)."""
        return self.outer - self.flat_shards()

    @torch.no_grad()
    def step(self, pseudo_gradient: torch.Tensor) -> None:
        """One outer SGD step with the (averaged) pseudo-gradient, then reset the model's shard to the result."""
        with self.lock:
            self.outer.grad = pseudo_gradient
            self.optimizer.param_groups[0]["lr"] = self.lr_at(self.steps)
            self.optimizer.step()
            self.outer.grad = None
            self._reset_shards()
            self.steps += 1

    def lr_at(self, step: int) -> float:
        """The outer lr of outer step `step` (counted from 0)."""
        return self.lr * min(1.0, (step + 1) / self.warmup) if self.warmup else self.lr

    @torch.no_grad()
    def reset_shards(self) -> None:
        """Set the model's shard to the outer parameters (the inner steps since the last outer step are lost)."""
        with self.lock:
            self._reset_shards()

    def _reset_shards(self) -> None:
        offset = 0
        for shard in self.shards:
            shard.copy_(self.outer[offset : offset + shard.numel()].view_as(shard))
            offset += shard.numel()

    def model_is_outer(self) -> bool:
        """Whether the model's shard holds exactly the outer parameters."""
        return torch.equal(self.flat_shards(), self.outer)

    # ------------------------------------------------------------------ the state other groups download

    def export(self) -> list[torch.Tensor]:
        """Copies of the outer parameters and, once there is one, the momentum buffer."""
        with self.lock:
            tensors = [self.outer.clone()]
            momentum = self.optimizer.state.get(self.outer, {}).get("momentum_buffer")
            if momentum is not None:
                tensors.append(momentum.clone())
        return tensors

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether `export()` of another group's same rank could have made `tensors`: one or two float32
        tensors of this shard's size."""
        outer = tensors[0]
        fits = outer.dtype == torch.float32 and outer.numel() == self.outer.numel() and len(tensors) <= 2
        return fits and all(t.shape == outer.shape for t in tensors)

    @torch.no_grad()
    def load(self, steps: int, tensors: list[torch.Tensor]) -> None:
        """Take over another group's exported state (see `fits`) and reset the model's shard to it."""
        with self.lock:
            self.outer.copy_(tensors[0].reshape(-1))
            state = self.optimizer.state[self.outer]
            if len(tensors) > 1:
                state["momentum_buffer"] = tensors[1].reshape(-1).clone()
            else:
                state.pop("momentum_buffer", None)
            self.steps = steps
            self._reset_shards()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {"outer": self.outer.clone(), "optimizer": self.optimizer.state_dict(), "outer_step": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's outer state; an empty one (from a galaxy-size-1 run) starts from the model's weights."""
        with self.lock:
            if not state:
                self.outer.copy_(self.flat_shards())
            else:
                self.outer.copy_(state["outer"])
                self.optimizer.load_state_dict(state["optimizer"])
                self.steps = state["outer_step"]

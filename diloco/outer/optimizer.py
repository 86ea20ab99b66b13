"""The DiLoCo outer step in plain torch: a rank's shard of the outer parameters and their Nesterov SGD.

Every H inner steps each rank of a worker group takes its shard of the model (FSDP leaves each rank its own),
flattens it to float32 on CPU, and computes the pseudo-gradient: outer parameters − current parameters. Once the
swarm averaged it (``diloco.outer.diloco``), an SGD step with Nesterov momentum moves the outer parameters, which
stay off the accelerator, and the model's shard is reset to them. The inner optimizer and its state are never
touched. Nothing here knows of other groups or of the network.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from diloco.outer.fragments import Runs


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
    :param fragments: with ``--hv.fragments F``, where each fragment's parameters sit in the flat shard
        (``diloco.outer.fragments.local_runs``); a round then steps one fragment. None: one fragment, the whole shard.
    """

    def __init__(
        self,
        shards: list[torch.Tensor],
        lr: float,
        momentum: float,
        warmup: int = 0,
        fragments: list[Runs] | None = None,
    ) -> None:
        self.shards = [s for s in shards if s.numel() > 0]  # FSDP can leave a rank an empty shard
        self.outer = self.flat_shards()
        self.optimizer = torch.optim.SGD([self.outer], lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.lr, self.momentum, self.warmup = lr, momentum, warmup
        self.steps = 0  # outer steps applied to `outer` (with fragments: fragment rounds)
        self.lock = threading.RLock()
        # called under `lock` just before the outer state changes in place (answers to downloads reading it copy it)
        self.before_change: Callable[[], None] = lambda: None
        ends = list(itertools.accumulate(s.numel() for s in self.shards))
        self._spans = list(zip([0, *ends[:-1]], ends))  # each shard's [start, stop) in the flat shard
        self.whole: Runs = [(0, self.outer.numel())] if self.outer.numel() else []
        self.fragments = fragments or [self.whole]
        # the last pseudo-gradient's and the last step's seconds (device to host, and the step plus host to device)
        self.timings = {"pseudo_gradient_s": 0.0, "outer_apply_s": 0.0}

    def flat_shards(self) -> torch.Tensor:
        """The model's current shard, flattened, as a new float32 CPU tensor."""
        return torch.cat([s.detach().reshape(-1).to("cpu", torch.float32) for s in self.shards])

    def numel(self, fragment: int | None = None) -> int:
        """Values of this rank's shard in `fragment` (None: all)."""
        return sum(b - a for a, b in self._runs(fragment))

    def _runs(self, fragment: int | None) -> Runs:
        return self.whole if fragment is None else self.fragments[fragment]

    def _pieces(self, runs: Runs) -> Iterator[tuple[torch.Tensor, int, int]]:
        """(a flat view of the model's shard, its [start, stop) in the flat shard) for every piece in `runs`."""
        for a, b in runs:
            for (lo, hi), shard in zip(self._spans, self.shards):
                start, stop = max(a, lo), min(b, hi)
                if start < stop:
                    yield shard.detach().view(-1)[start - lo : stop - lo], start, stop

    @torch.no_grad()
    def pseudo_gradient(self, fragment: int | None = None) -> torch.Tensor:
        """Outer parameters − current parameters of `fragment` (None: all), its runs concatenated (a new tensor,
        averaged in place by the swarm)."""
        started = time.perf_counter()
        if fragment is None:  # in place: one new tensor of the shard's size, not the model's copy and then the result
            result = self.flat_shards().neg_().add_(self.outer)
        else:
            runs = self._runs(fragment)
            parts = [self.outer[a:b] - view.to("cpu", torch.float32) for view, a, b in self._pieces(runs)]
            result = torch.cat(parts) if parts else torch.zeros(0)
        self.timings["pseudo_gradient_s"] = time.perf_counter() - started  # the copy waits for the device
        return result

    @torch.no_grad()
    def step(self, pseudo_gradient: torch.Tensor, fragment: int | None = None, mix: float = 0.0) -> None:
        """One outer SGD step with the (averaged) pseudo-gradient of `fragment` (None: all), then set the model's
        shard there to the result; with `mix` > 0 (overlapped rounds) to mix × the model's values + (1 − mix) ×
        the result instead, keeping a share of the inner steps taken while the round was on the wire."""
        with self.lock:
            self.before_change()
            started = time.perf_counter()
            lr = self.lr_at(self.steps // len(self.fragments))  # the warm-up counts whole passes over the model
            if fragment is None:
                self.outer.grad = pseudo_gradient
                self.optimizer.param_groups[0]["lr"] = lr
                self.optimizer.step()
                self.outer.grad = None
            else:
                self._step_runs(pseudo_gradient, self.fragments[fragment], lr)
            self._write(self._runs(fragment), mix)
            self.steps += 1
            self.timings["outer_apply_s"] = time.perf_counter() - started

    def _step_runs(self, pseudo_gradient: torch.Tensor, runs: Runs, lr: float) -> None:
        """torch's SGD update (Nesterov when momentum > 0) on the runs of the flat shard alone; the momentum of
        the other runs waits for their own fragment's round."""
        buffer = None
        if self.momentum:
            state = self.optimizer.state[self.outer]
            buffer = state.setdefault("momentum_buffer", torch.zeros_like(self.outer))
        offset = 0
        for a, b in runs:
            grad = pseudo_gradient[offset : offset + b - a]
            offset += b - a
            if buffer is not None:
                buffer[a:b].mul_(self.momentum).add_(grad)
                grad = grad.add(buffer[a:b], alpha=self.momentum)
            self.outer[a:b].add_(grad, alpha=-lr)

    def _write(self, runs: Runs, mix: float) -> None:
        """Set the model's shard in `runs` to the outer parameters (mixed with its own values when `mix` > 0)."""
        for view, a, b in self._pieces(runs):
            outer = self.outer[a:b].to(view.device, view.dtype)
            if mix:
                view.mul_(mix).add_(outer, alpha=1.0 - mix)
            else:
                view.copy_(outer)

    def lr_at(self, step: int) -> float:
        """The outer lr of outer step `step` (counted from 0)."""
        return self.lr * min(1.0, (step + 1) / self.warmup) if self.warmup else self.lr

    @torch.no_grad()
    def reset_shards(self) -> None:
        """Set the model's shard to the outer parameters (the inner steps since the last outer step are lost)."""
        with self.lock:
            self._write(self.whole, 0.0)

    def model_is_outer(self) -> bool:
        """Whether the model's shard holds exactly the outer parameters."""
        return torch.equal(self.flat_shards(), self.outer)

    # ------------------------------------------------------------------ the state other groups download

    def tensors(self) -> list[torch.Tensor]:
        """The outer parameters and, once there is one, the momentum buffer: the state other groups download and its
        digest covers (not copies: hold ``lock``)."""
        momentum = self.optimizer.state.get(self.outer, {}).get("momentum_buffer")
        return [self.outer] if momentum is None else [self.outer, momentum]

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether `tensors()` of another group's same rank could be `tensors`: one or two float32
        tensors of this shard's size."""
        outer = tensors[0]
        fits = outer.dtype == torch.float32 and outer.numel() == self.outer.numel() and len(tensors) <= 2
        return fits and all(t.shape == outer.shape for t in tensors)

    @torch.no_grad()
    def load(self, steps: int, tensors: list[torch.Tensor], keep: bool = False) -> None:
        """Take over another group's downloaded state (see `fits`) and reset the model's shard to it; with `keep`,
        move the model's shard by as much as the outer parameters moved instead, so that it keeps the inner steps
        taken since its last round: every fragment's pseudo-gradient is what it was (up to rounding)."""
        with self.lock:
            self.before_change()
            loaded = tensors[0].reshape(-1)
            if keep:  # piece by piece: no temporary of the whole shard's size
                for view, a, b in self._pieces(self.whole):
                    view.add_((loaded[a:b] - self.outer[a:b]).to(view.device, view.dtype))
            self.outer.copy_(loaded)
            state = self.optimizer.state[self.outer]
            if len(tensors) > 1:  # into the buffer there is: no second one beside it (`tensors` may be shared)
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.empty_like(self.outer)
                state["momentum_buffer"].copy_(tensors[1].reshape(-1))
            else:
                state.pop("momentum_buffer", None)
            self.steps = steps
            if not keep:
                self._write(self.whole, 0.0)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The outer parameters and momentum themselves, not copies (a copy would cost a shard of the model while a
        checkpoint is written): save them before the next outer step or load."""
        return {"outer": self.outer, "optimizer": self.optimizer.state_dict(), "outer_step": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's outer state; an empty one (from a galaxy-size-1 run) starts from the model's weights."""
        with self.lock:
            self.before_change()
            if not state:
                self.outer.copy_(self.flat_shards())
            else:
                self.outer.copy_(state["outer"])
                self.optimizer.load_state_dict(state["optimizer"])
                self.steps = state["outer_step"]

"""The inner AdamW with the galaxy's second moment (`--hv.inner-moment galaxy`).

Why: AdamW divides each step by the root of its second moment, E[g²] = mean² + variance. A group's gradient comes
from its own batch, with k times the variance of the gradient of all k groups' batches together (what DDP over the
galaxy would see), so where the noise dominates a group's step is up to √k shorter than DDP's. Averaging the k
groups' pseudo-gradients cancels their noise but keeps the shortened signal: the steady part of DiLoCo's gap to
DDP in short runs (docs/benchmarks.md, 2026-11-26, issue 15). Here each step's gradient variance is estimated from
the step's two halves of micro-batches, and the second moment AdamW divides by is the one of a batch `k` times as
large: the step DDP over the galaxy would take, in the direction of this group's own gradient.

The estimate: with a step's micro-batches in a first part of weight W (its share of the step's sequences) and the
rest, gradients gA and gB of the two parts and G = W gA + (1 - W) gB, E[(gA - gB)² W (1 - W)] = Var(G) per
coordinate. Both parts are reduced over the group's ranks, so it is the variance of the group's gradient.

Everything is elementwise, so it works on each rank's shards (FSDP2) or replicas (DDP) alike; not under ZERO1,
whose optimizer only sees a partition.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


class GalaxyAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) whose second moment is that of a batch
    `galaxy_batches` times this group's: v = max(E[g²] - (1 - 1/k) E[Var g], E[g²] / k), both moving averages of
    the same β2. The floor is the noise-only case (mean 0), so an unlucky variance estimate never grows a step by
    more than √k. With k = 1 it is AdamW. `observe` gives each step's variance before `step`."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        galaxy_batches: float,
        eps: float = 1e-8,
    ) -> None:
        if galaxy_batches < 1:
            raise ValueError(f"galaxy_batches {galaxy_batches} must be at least 1")
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "eps": eps, "galaxy_batches": galaxy_batches}
        super().__init__(params, defaults)
        self.variance: dict[torch.Tensor, torch.Tensor] = {}  # this step's estimate per parameter (`observe`)

    def observe(self, variance: dict[torch.Tensor, torch.Tensor]) -> None:
        """The variance of this step's gradient, per parameter, for the next `step`."""
        self.variance = variance

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, (beta1, beta2), k = group["lr"], group["betas"], group["galaxy_batches"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    for key in ("exp_avg", "exp_avg_sq", "exp_var"):
                        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                grad, exp_avg, exp_avg_sq, exp_var = p.grad, state["exp_avg"], state["exp_avg_sq"], state["exp_var"]
                p.mul_(1 - lr * group["weight_decay"])
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                variance = self.variance.get(p)
                if variance is not None:
                    exp_var.mul_(beta2).add_(variance, alpha=1 - beta2)
                second = torch.maximum(exp_avg_sq - (1 - 1 / k) * exp_var, exp_avg_sq / k)
                denom = (second / (1 - beta2**t)).sqrt_().add_(group["eps"])
                p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**t))
        self.variance = {}


class Halves:
    """Splits an inner step's micro-batches in two parts and estimates the variance of the step's gradient.

    The caller also reduces the gradients over the group after the first part's last micro-batch, calls `snapshot`
    there, and `observe` once the step's gradient is unscaled and clipped."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.first: list[torch.Tensor | None] = []

    @staticmethod
    def split(pieces: list[torch.Tensor]) -> tuple[list[torch.Tensor], int, float]:
        """The step's micro-batches, one split in two if there is only one; the number in the first part and
        its share W of the sequences."""
        if len(pieces) == 1:
            if len(pieces[0]) < 2:
                raise ValueError("a micro-batch of one sequence has no halves")
            pieces = list(pieces[0].chunk(2))
        first = len(pieces) // 2
        sizes = [len(piece) for piece in pieces]
        return pieces, first, sum(sizes[:first]) / sum(sizes)

    def snapshot(self) -> None:
        """The first part's gradient (reduced over the group), as it stands after its last micro-batch."""
        self.first = [None if p.grad is None else p.grad.detach().clone() for p in self.params]

    def observe(self, optimizer: GalaxyAdamW, share: float, scale: float, clip: float) -> None:
        """Hand the optimizer each parameter's variance estimate: with F the snapshot (times `scale`, the gradient
        scaler's factor), G the step's gradient before clipping and c the clip factor (p.grad = c G),
        Var(c G) = c² (F / scale - W G)² / (W (1 - W)) = (c F / scale - W p.grad)² / (W (1 - W))."""
        variance = {}
        for p, first in zip(self.params, self.first, strict=True):
            if first is None or p.grad is None:
                continue
            first.mul_(clip / scale).sub_(p.grad, alpha=share)
            variance[p] = first.square_().div_(share * (1 - share))
        self.first = []
        optimizer.observe(variance)


def clip_factor(total_norm: torch.Tensor, max_norm: float) -> float:
    """What `clip_grad_norm_` multiplied the gradients by (its own formula), from the norm it returned."""
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    return min(1.0, max_norm / (float(total_norm) + 1e-6))

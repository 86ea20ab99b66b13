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
            buckets: dict[float, _Bucket] = {}  # by step count: each bucket shares its bias corrections
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    for key in ("exp_avg", "exp_avg_sq", "exp_var"):
                        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                bucket = buckets.setdefault(float(state["step"]), _Bucket())
                bucket.add(p, state, self.variance.get(p))
            for t, bucket in buckets.items():
                _step(bucket, group, t)
        self.variance = {}


class _Bucket:
    """The local tensors (each rank's shard under FSDP2) of the parameters that take a step at one step count:
    every operation below is elementwise, so the shards step as the whole would, and multi-tensor ops on plain
    tensors cost a fraction of one DTensor dispatch per operation and parameter."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []
        self.exp_vars: list[torch.Tensor] = []
        self.observed_vars: list[torch.Tensor] = []  # the exp_var of parameters with an estimate this step
        self.estimates: list[torch.Tensor] = []

    def add(self, p: torch.Tensor, state: dict, variance: torch.Tensor | None) -> None:
        self.params.append(local(p))
        self.grads.append(local(p.grad))  # type: ignore[arg-type]
        self.exp_avgs.append(local(state["exp_avg"]))
        self.exp_avg_sqs.append(local(state["exp_avg_sq"]))
        self.exp_vars.append(local(state["exp_var"]))
        if variance is not None:
            self.observed_vars.append(self.exp_vars[-1])
            self.estimates.append(local(variance))


def _step(b: _Bucket, group: dict, t: float) -> None:
    """One GalaxyAdamW step of a bucket's parameters at step count t."""
    lr, (beta1, beta2), k = group["lr"], group["betas"], group["galaxy_batches"]
    torch._foreach_mul_(b.params, 1 - lr * group["weight_decay"])
    torch._foreach_lerp_(b.exp_avgs, b.grads, 1 - beta1)
    torch._foreach_mul_(b.exp_avg_sqs, beta2)
    torch._foreach_addcmul_(b.exp_avg_sqs, b.grads, b.grads, value=1 - beta2)
    if b.observed_vars:
        torch._foreach_mul_(b.observed_vars, beta2)
        torch._foreach_add_(b.observed_vars, b.estimates, alpha=1 - beta2)
    second = torch._foreach_mul(b.exp_vars, 1 - 1 / k)
    torch._foreach_sub_(second, b.exp_avg_sqs)
    torch._foreach_neg_(second)  # E[g²] - (1 - 1/k) E[Var g] ...
    torch._foreach_maximum_(second, torch._foreach_div(b.exp_avg_sqs, k))  # ... never below E[g²] / k
    torch._foreach_div_(second, 1 - beta2**t)
    torch._foreach_sqrt_(second)
    torch._foreach_add_(second, group["eps"])
    torch._foreach_addcdiv_(b.params, b.exp_avgs, second, value=-lr / (1 - beta1**t))


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: in-place ops on it change the DTensor), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


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

    @torch.no_grad()
    def snapshot(self) -> None:
        """The first part's gradient (reduced over the group), as it stands after its last micro-batch."""
        self.first = [None if p.grad is None else local(p.grad).clone() for p in self.params]

    @torch.no_grad()
    def observe(self, optimizer: GalaxyAdamW, share: float, scale: float, clip: float) -> None:
        """Hand the optimizer each parameter's variance estimate: with F the snapshot (times `scale`, the gradient
        scaler's factor), G the step's gradient before clipping and c the clip factor (p.grad = c G),
        Var(c G) = c² (F / scale - W G)² / (W (1 - W)) = (c F / scale - W p.grad)² / (W (1 - W))."""
        pairs = [(p, first) for p, first in zip(self.params, self.first, strict=True)
                 if first is not None and p.grad is not None]  # fmt: skip
        firsts = [first for _, first in pairs]
        if firsts:
            torch._foreach_mul_(firsts, clip / scale)
            torch._foreach_sub_(firsts, [local(p.grad) for p, _ in pairs], alpha=share)  # type: ignore[arg-type]
            torch._foreach_pow_(firsts, 2.0)
            torch._foreach_div_(firsts, share * (1 - share))
        variance = {p: first for p, first in pairs}
        self.first = []
        optimizer.observe(variance)


def clip_factor(total_norm: torch.Tensor, max_norm: float) -> float:
    """What `clip_grad_norm_` multiplied the gradients by (its own formula), from the norm it returned."""
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    return min(1.0, max_norm / (float(total_norm) + 1e-6))

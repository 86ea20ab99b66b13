"""How a reducer combines the screened contributions to one part (``--hv.aggregation``).

- ``mean``: the weighted mean. One contributor moves it without bound: a peer sending 50 times its pseudo-gradient
  (which the norm screen of ``diloco.swarm.rounds.screening`` lets through) outweighs ten honest peers.
- ``trimmed-mean``: per coordinate, the ``trim_count(n)`` largest and smallest values are dropped and the rest
  averaged with their senders' weights. It tolerates that many hostile contributors per part.
- ``centered-clip``: centered clipping (Karimireddy, He & Jaggi, 2021), from the coordinate-wise median: each
  contribution's pull on the centre is clipped to the median distance of the contributions from it, over
  ``CLIP_ITERATIONS`` passes. A hostile contributor moves the result by a bounded amount, whatever it sends.

A robust rule needs at least ``ROBUST_MIN`` contributions with a positive weight; with fewer it is the mean (two
contributors cannot outvote each other). Contributions of weight 0 (a group that joined mid-round) add nothing
under any rule. Under a robust rule a contribution counts at most as much as the median one (``votes``): the rules
bound what one contributor does by counting contributors, and a weight that is a multiple of the others' (up to the
cap of ``diloco.swarm.rounds.screening``) would bring that back.

Every part is combined once, by its reducer, and the same bytes go to every group, so groups stay bit-identical
whatever the rule; the rules are deterministic all the same (stable sorts, fixed summation order). Plain torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import torch

from diloco.config import ROBUST_MIN, Aggregation

AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
# passes of centered clipping: each moves the centre towards the honest majority; three reach within a few percent
# of the fixed point for the attacks of `diloco bench poison` (more cost a pass over the contributions each)
CLIP_ITERATIONS = 3


def trim_count(n: int) -> int:
    """Values dropped at each end of every coordinate among n contributions: a fifth, at least one (n = 3: the
    median)."""
    return max(1, n // 5)


def aggregate(parts: Sequence[torch.Tensor], weights: Sequence[float], rule: Aggregation) -> torch.Tensor:
    """The contributions `parts` (1-d float32 tensors of one length, in sender order) combined by `rule`; a new
    tensor. Weights are finite and >= 0 (screened); none positive gives NaN (0/0), which fails the round."""
    live = [(part, weight) for part, weight in zip(parts, weights) if weight > 0]
    if rule == "mean" or len(live) < ROBUST_MIN:
        return weighted_mean(parts, weights)
    stacked = torch.stack([part for part, _ in live])
    scale = votes(torch.tensor([weight for _, weight in live], dtype=stacked.dtype))
    if rule == "trimmed-mean":
        return trimmed_mean(stacked, scale)
    if rule == "centered-clip":
        return centered_clip(stacked, scale)
    raise ValueError(f"unknown aggregation {rule!r}")


def votes(weights: torch.Tensor) -> torch.Tensor:
    """`weights` (all positive) capped at their lower median: under a robust rule no contribution outvotes the median
    one, however much it announced; honest groups of unequal speed count alike above the median."""
    median = weights.sort().values[(len(weights) - 1) // 2]
    return weights.clamp(max=float(median))


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ w·x / Σ w, summed in sender order."""
    total = torch.zeros_like(parts[0])
    for part, weight in zip(parts, weights):
        total.add_(part, alpha=weight)
    return total.div_(sum(weights))


def trimmed_mean(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per coordinate of `stacked` (n x m), the weighted mean of the values left once the `trim_count(n)` largest
    and smallest are dropped; ties keep sender order (a stable sort)."""
    n = stacked.shape[0]
    drop = trim_count(n)
    values, senders = torch.sort(stacked, dim=0, stable=True)
    kept, kept_weights = values[drop : n - drop], weights[senders[drop : n - drop]]
    return (kept * kept_weights).sum(dim=0) / kept_weights.sum(dim=0)


def centered_clip(stacked: torch.Tensor, weights: torch.Tensor, iterations: int = CLIP_ITERATIONS) -> torch.Tensor:
    """Centered clipping of the rows of `stacked` (n x m), from their coordinate-wise (lower) median, with the
    radius tau = the lower median of the rows' distances from it: c <- c + Σ w_i·min(1, tau/|x_i - c|)·(x_i - c)
    / Σ w_i. An honest majority lies within tau of the median; a row further away pulls by tau at most."""
    center = stacked.median(dim=0).values
    distances = torch.linalg.vector_norm(stacked - center, dim=1)
    tau = distances.sort().values[(len(distances) - 1) // 2]
    share = weights / weights.sum()
    for _ in range(iterations):
        offsets = stacked - center
        distances = torch.linalg.vector_norm(offsets, dim=1)
        # within tau: the whole offset; further: tau of it (a zero distance is within, even with tau = 0)
        clip = torch.where(distances > tau, tau / distances.clamp_min(torch.finfo(distances.dtype).tiny), 1.0)
        center = center + (share * clip) @ offsets
    return center

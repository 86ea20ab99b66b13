"""Screening pseudo-gradients before they are averaged: finiteness, part norms and the rejection rule.

A reducer (the peer that averages one span of the vector) judges every contribution to each of its parts before
adding it: NaN/Inf values, a weight that is not a finite number >= 0, or an L2 norm far above the group's are
left out. Both transports (``diloco.swarm.rounds.tcp`` and ``diloco.bench.libp2p``) apply this rule, and the outer loop
checks its own pseudo-gradient with ``all_finite`` before it averages.

Weights are bounded before any of that: a group's weight in a round is the one it announced in matchmaking, capped
at ``MAX_WEIGHT_RATIO`` times the round's reference weight (``capped_weights``); every member computes the same
capped weights from the same announcements, so a reducer never counts a weight a sender puts on the wire. Plain torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

# A contribution to a part is rejected when its L2 norm exceeds this many times the lower median of the group's
# norms for that part. Peers' pseudo-gradients come from the same parameters after the same number of inner
# steps, so honest ones are within a small factor of each other; a diverged peer (loss spike, overflow, corrupt
# data) is off by orders of magnitude, and at 100x it would outweigh ~100 honest peers in the mean. 100 leaves
# over an order of magnitude of headroom for honest spread (few-step warm-up, uneven data) before a peer is cut.
# With two peers the median is the smaller norm: the larger contribution is the one dropped.
MAX_NORM_RATIO = 100.0

# A group's weight in a round is capped at this many times the lower median of the positive weights its members
# announced. Honest weights are 1 (--hv.local-steps) or the tokens a group trained in the round (--hv.target-tokens:
# its throughput over the round's time), so they differ by the groups' speeds: a few times between GPU generations,
# rarely over 10x between groups a swarm would pair. 16 leaves that spread untouched; a group announcing 1e30 counts
# as 16 median groups at most instead of outweighing the round (with `mean` its part would be the result). The lower
# median is an honest weight as long as hostile members are at most as many as honest ones.
MAX_WEIGHT_RATIO = 16.0


def reference_weight(weights: Iterable[float]) -> float:
    """The weight a round's weights are capped against: the lower median of the positive finite ones (0: none). A
    group that joined mid-round announces 0 and adds nothing; counting it would let it lower everyone's cap."""
    positive = sorted(w for w in weights if math.isfinite(w) and w > 0)
    return positive[(len(positive) - 1) // 2] if positive else 0.0


def capped_weights(weights: Sequence[float], max_ratio: float = MAX_WEIGHT_RATIO) -> list[float]:
    """The round's members' announced `weights` (in the round's order), each capped at `max_ratio` times their
    ``reference_weight``; every member computes the same list from the same announcements. Weights that are not a
    finite number >= 0 pass unchanged, for ``rejection`` to refuse."""
    cap = max_ratio * reference_weight(weights)
    return [min(w, cap) if math.isfinite(w) and w > cap else w for w in weights]


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether no value is NaN or +-Inf. ``torch.aminmax`` propagates both and allocates nothing: one pass, about
    30x faster than ``torch.isfinite(tensor).all()`` on 50M float32 values (16 ms against 0.5 s here)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def part_norm(part: torch.Tensor) -> float:
    """L2 norm; nan or inf iff a value is. Computed in the part's float32 (one fast pass); only when that
    overflows on finite values (a norm over ~3.4e38) again with float64 accumulation."""
    norm = float(torch.linalg.vector_norm(part))
    return norm if math.isfinite(norm) else float(torch.linalg.vector_norm(part, dtype=torch.float64))


def reference_norm(norms: Iterable[float]) -> float:
    """The norm contributions to one part are judged against: the lower median of the finite ones (0: none)."""
    finite = sorted(norm for norm in norms if math.isfinite(norm))
    return finite[(len(finite) - 1) // 2] if finite else 0.0


def rejection(norm: float, weight: float, reference: float, max_ratio: float = MAX_NORM_RATIO) -> str | None:
    """Why to reject a contribution of L2 norm ``norm`` and weight ``weight`` to a part whose ``reference_norm`` is
    ``reference``, or None to accept it: NaN or Inf values, a weight that is not a finite number >= 0, or a norm
    over ``max_ratio`` times the reference."""
    if not math.isfinite(norm):
        return "non-finite values"
    if not math.isfinite(weight) or weight < 0:
        return f"invalid weight {weight}"
    if reference > 0 and norm > max_ratio * reference:
        return f"L2 norm {norm:.3g} is {norm / reference:.3g} times the group's median {reference:.3g}"
    return None


def screen(norms: dict[int, float], weights: dict[int, float], max_ratio: float = MAX_NORM_RATIO) -> dict[int, str]:
    """Why to reject each sender's contribution to one part (``rejection``); senders absent from the result are
    accepted."""
    reference = reference_norm(norms.values())
    reasons = {sender: rejection(norm, weights[sender], reference, max_ratio) for sender, norm in norms.items()}
    return {sender: reason for sender, reason in reasons.items() if reason is not None}

"""What ``auto`` picks for the outer step and the inner AdamW's second moment, and the swarm-wide H they follow.

Every value comes from `diloco bench convergence`; docs/outer-step.md holds the studies behind each (what was
compared, the figures, the bench sections). The picks depend only on H, the galaxy size, the inner warm-up and the
run's length, which every group of a swarm shares, so every group takes the same outer step.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from diloco.config import Config, HvConfig, InnerMoment
from diloco.errors import UsageError


class OuterSetting(NamedTuple):
    """The outer SGD of a run: lr, Nesterov momentum (0: plain SGD), and the outer steps over which the lr rises
    linearly to `lr` (0: none)."""

    lr: float
    momentum: float
    warmup: int


# --hv.inner-moment auto: the galaxy's second moment for this many groups or more, at H up to this (it helped 3-8
# groups at H <= 25 and cost 2 groups, and 4 groups at H >= 50), where a step's halves are whole micro-batches (this
# many per rank): splitting a lone one costs each step a second pass, about even with the moment's gain on a quiet
# host and a loss on a busy one (docs/outer-step.md)
AUTO_GALAXY_MIN_K, AUTO_GALAXY_MAX_H, AUTO_GALAXY_MIN_MICRO_BATCHES = 3, 25, 2
# runs of this many outer steps or more take the paper's 0.7 / 0.9 (best or within 1.5 points in the map study);
# shorter runs take no momentum (0.9 ended 9-48% above DDP at 4-8 outer steps) and the lr below
AUTO_MOMENTUM_STEPS = 50
# (largest H, largest galaxy size, outer lr), first match wins: above 1 only with the warm-up below
AUTO_LR: tuple[tuple[float, float, float], ...] = (
    (100, 2, 1.4),
    (AUTO_GALAXY_MAX_H, math.inf, 1.3),  # 3+ groups with the galaxy moment
    (100, math.inf, 1.2),
    (math.inf, math.inf, 1.0),
)
# --hv.outer-lr-warmup auto, up to this H: the outer lr rises over the outer steps that cover this many inner
# warm-ups (the harm is in the first outer steps, while the inner lr warms up)
AUTO_WARMUP_H, AUTO_WARMUP_SPAN = 100, 3
# ... at most this share of the run's outer steps, never capped below the floor (a long inner warm-up would
# otherwise keep the outer lr low for most of a short run)
AUTO_WARMUP_SHARE, AUTO_WARMUP_FLOOR = 3 / 8, 3


def auto_outer(h: float, galaxy_size: int, warmup_steps: int, max_steps: int) -> OuterSetting:
    """The outer setting `auto` picks for H inner steps per outer step, `galaxy_size` groups, an inner warm-up
    of `warmup_steps` steps and a run of `max_steps` inner steps."""
    if max_steps / h >= AUTO_MOMENTUM_STEPS:
        return OuterSetting(0.7, 0.9, 0)
    lr = next(lr for max_h, max_k, lr in AUTO_LR if h <= max_h and galaxy_size <= max_k)
    warmup = math.ceil(AUTO_WARMUP_SPAN * warmup_steps / h) if h <= AUTO_WARMUP_H else 0
    warmup = min(warmup, max(AUTO_WARMUP_FLOOR, math.ceil(AUTO_WARMUP_SHARE * max_steps / h)))
    return OuterSetting(lr, 0.0, warmup if warmup > 1 else 0)  # one step of warm-up is none


def auto_inner_moment(h: float, galaxy_size: int, micro_batches: int) -> InnerMoment:
    """The inner AdamW's second moment `auto` picks for H inner steps per outer step, `galaxy_size` groups and
    `micro_batches` per rank in an inner step."""
    helps = galaxy_size >= AUTO_GALAXY_MIN_K and h <= AUTO_GALAXY_MAX_H
    return "galaxy" if helps and micro_batches >= AUTO_GALAXY_MIN_MICRO_BATCHES else "group"


def steps_per_round(hv: HvConfig, tokens_per_step: int) -> float:
    """H: --hv.local-steps (under --hv.pace tokens too: the budget follows it), or under --hv.target-tokens N that
    of equal groups (N ÷ (galaxy size × tokens per inner step))."""
    given = hv.budget_given()
    if given is not None:
        return given / (hv.galaxy_size * max(tokens_per_step, 1))
    return hv.local_steps


def outer_setting(config: Config, tokens_per_step: int, max_steps: int) -> OuterSetting:
    """The outer SGD's lr, momentum and lr warm-up: each as set, or for "auto" from `auto_outer` for this run's H
    (`steps_per_round`), galaxy size, inner warm-up and length.

    :param tokens_per_step: tokens of one inner step of this group (all ranks).
    :param max_steps: the run's inner steps (--max-steps, or from --epochs).
    """
    hv = config.hv
    auto = auto_outer(steps_per_round(hv, tokens_per_step), hv.galaxy_size, config.warmup_steps, max_steps)
    if hv.compression == "sparse" and hv.sparse_rule == "sparseloco":  # the error buffer is the momentum
        auto = OuterSetting(1.0, 0.0, auto.warmup)
    return OuterSetting(
        auto.lr if hv.outer_lr == "auto" else hv.outer_lr,
        auto.momentum if hv.outer_momentum == "auto" else hv.outer_momentum,
        auto.warmup if hv.outer_lr_warmup == "auto" else hv.outer_lr_warmup,
    )


def galaxy_moment(config: Config, tokens_per_step: int, grad_accum: int) -> bool:
    """Whether the inner AdamW takes the galaxy's second moment (--hv.inner-moment, auto resolved for this run's H,
    galaxy size and micro-batches). It splits each step's micro-batches in two halves: `auto` keeps plain AdamW
    where that would split a lone micro-batch, and under ZERO1; `galaxy` splits one, and refuses a step with no
    halves (one micro-batch of one sequence)."""
    hv = config.hv
    if hv.galaxy_size == 1:
        return False
    choice = hv.inner_moment
    if choice == "auto":
        choice = auto_inner_moment(steps_per_round(hv, tokens_per_step), hv.galaxy_size, grad_accum)
    # auto picks galaxy only with two micro-batches or more, so a step without halves is an explicit galaxy's
    if choice == "galaxy" and grad_accum < 2 and config.per_device_train_batch_size < 2:
        raise UsageError("--hv.inner-moment galaxy needs two halves of each inner step: a "
                         "--per-device-train-batch-size of at least 2, or a --total-batch-size of two "
                         "micro-batches per rank")  # fmt: skip
    return choice == "galaxy" and config.sharding_strategy != "ZERO1"

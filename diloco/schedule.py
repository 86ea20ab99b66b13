"""The inner learning-rate schedule: a linear warmup, then a half cosine down to zero at the last step.

The same curve as transformers' ``get_cosine_schedule_with_warmup`` (tests compare them), written here because
importing transformers' optimization module imports its trainer utilities and with them peft: seconds at the start
of every rank, for a function of four lines."""

from __future__ import annotations

import functools
import math

import torch


def cosine_factor(step: int, *, warmup: int, total: int) -> float:
    """The learning rate at `step` as a fraction of the peak."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def cosine_with_warmup(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler that warms up over `warmup` steps and decays to zero at step `total`."""
    # a partial, not a closure: LambdaLR's state dict then holds the same entry as transformers' scheduler's
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(cosine_factor, warmup=warmup, total=total))

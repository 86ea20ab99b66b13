"""diloco.schedule: the inner learning-rate schedule is transformers' cosine with warmup, step for step."""

from __future__ import annotations

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from diloco.schedule import cosine_with_warmup


def lrs(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize(("warmup", "total"), [(0, 1), (0, 10), (3, 10), (10, 10), (5, 3), (2, 50)])
def test_the_curve_is_transformers_cosine_with_warmup(warmup: int, total: int) -> None:
    def optimizer() -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)

    ours = lrs(cosine_with_warmup(optimizer(), warmup, total), total + 3)  # past the end too
    theirs = lrs(get_cosine_schedule_with_warmup(optimizer(), warmup, total), total + 3)
    assert ours == theirs
    assert max(ours) == pytest.approx(3e-4)
    if total > warmup:
        assert ours[total] == pytest.approx(0.0, abs=1e-20)


def test_a_state_dict_of_either_loads_into_the_other() -> None:
    params = [torch.nn.Parameter(torch.zeros(1))]
    ours = cosine_with_warmup(torch.optim.SGD(params, lr=1.0), 2, 8)
    theirs = get_cosine_schedule_with_warmup(torch.optim.SGD(params, lr=1.0), 2, 8)
    for _ in range(5):
        theirs.optimizer.step()
        theirs.step()
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())  # a checkpoint written before this module existed
    assert ours.last_epoch == 5 and ours.get_last_lr() == theirs.get_last_lr()

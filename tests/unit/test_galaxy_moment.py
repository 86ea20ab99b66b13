"""The inner AdamW with the galaxy's second moment (diloco.galaxy_moment): its arithmetic, the variance estimate
from two halves of a step, and `auto`'s choice."""

from __future__ import annotations

import pytest
import torch

from diloco.config import Config
from diloco.errors import UsageError
from diloco.galaxy_moment import GalaxyAdamW, Halves, clip_factor
from diloco.outer.auto import auto_inner_moment, galaxy_moment

BETAS, WD = (0.9, 0.95), 0.1


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]


def test_with_one_groups_batch_it_takes_adamws_steps() -> None:
    """galaxy_batches 1 (the galaxy is this group): whatever the variance, the steps are AdamW's."""
    ours, theirs = params(), params()
    opt = GalaxyAdamW(ours, lr=0.01, betas=BETAS, weight_decay=WD, galaxy_batches=1.0)
    ref = torch.optim.AdamW(theirs, lr=0.01, betas=BETAS, weight_decay=WD)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.observe({p: p.grad.square() * 3 for p in ours})
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def first_step(variance_per_grad_square: float, k: float) -> torch.Tensor:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = GalaxyAdamW([p], lr=0.1, betas=BETAS, weight_decay=0.0, galaxy_batches=k)
    p.grad = torch.tensor([0.5, -2.0, 1e-3])
    opt.observe({p: p.grad.square() * variance_per_grad_square})
    opt.step()
    return p.detach().clone()


def test_a_step_of_pure_noise_is_sqrt_k_longer_and_of_no_noise_as_long() -> None:
    """The second moment of a k-times larger batch: a gradient that is all noise (variance = g²) has k times less
    of it, so the step is √k longer (the floor); one with no noise steps as AdamW does."""
    adam = first_step(0.0, 1.0)
    torch.testing.assert_close(first_step(0.0, 4.0), adam)
    torch.testing.assert_close(first_step(1.0, 4.0), 2 * adam, rtol=1e-5, atol=0)
    torch.testing.assert_close(first_step(5.0, 4.0), 2 * adam, rtol=1e-5, atol=0)  # an estimate above g²: the floor
    half = first_step(0.5, 4.0)  # E[g²] - 3/4 · g²/2 = 5/8 g²
    torch.testing.assert_close(half, adam / (5 / 8) ** 0.5, rtol=1e-5, atol=0)


def estimate(first: torch.Tensor, full: torch.Tensor, share: float, scale: float = 1.0, clip: float = 1.0) -> torch.Tensor:
    """What `Halves` hands the optimizer for one parameter whose first part's gradient (as the scaler left it)
    is `first` and whose step's gradient, unscaled and clipped, is `full`."""
    p = torch.nn.Parameter(torch.zeros_like(full))
    halves, opt = Halves([p]), GalaxyAdamW([p], lr=0.1, betas=BETAS, weight_decay=0.0, galaxy_batches=2.0)
    p.grad = first.clone()
    halves.snapshot()
    p.grad = full.clone()
    halves.observe(opt, share, scale, clip)
    return opt.variance[p]


@pytest.mark.parametrize("first_part", [4, 3])
def test_two_halves_estimate_the_variance_of_the_steps_gradient_without_bias(first_part: int) -> None:
    """Micro-batches of per-sample gradients with a known variance: the estimate's mean over many steps is the
    variance of the step's mean gradient, for equal halves and for a first part of 3 of 8."""
    n, trials, sigma = 8, 20000, torch.tensor([0.5, 2.0, 1.0])
    g = torch.Generator().manual_seed(2)
    samples = torch.tensor([1.0, -1.0, 0.0]) + sigma * torch.randn(trials, n, 3, generator=g)
    share = first_part / n
    estimates = estimate(samples[:, :first_part].sum(1) / n, samples.mean(1), share)  # elementwise: every trial at once
    torch.testing.assert_close(estimates.mean(0), sigma.square() / n, rtol=0.05, atol=0)


def test_the_scalers_factor_and_the_clip_are_taken_out() -> None:
    """The first part's snapshot carries the fp16 scaler's factor and no clip; the step's gradient is unscaled and
    clipped by c: the estimate is the variance of the clipped gradient, c² times the unclipped one's."""
    first, full = torch.tensor([0.3, -1.0]), torch.tensor([1.0, 0.5])
    plain = estimate(first, full, 0.5)
    torch.testing.assert_close(estimate(first * 1024, full * 0.25, 0.5, scale=1024, clip=0.25), plain * 0.25**2)
    assert clip_factor(torch.tensor(4.0), 1.0) == pytest.approx(0.25) and clip_factor(torch.tensor(0.5), 1.0) == 1.0


def test_one_micro_batch_is_split_in_two_and_several_in_two_parts() -> None:
    batch = torch.arange(10).reshape(5, 2)
    pieces, first, share = Halves.split([batch])
    assert [len(p) for p in pieces] == [3, 2] and first == 1 and share == pytest.approx(0.6)
    pieces, first, share = Halves.split([batch[:2], batch[2:4], batch[4:]])
    assert len(pieces) == 3 and first == 1 and share == pytest.approx(2 / 5)
    with pytest.raises(ValueError):
        Halves.split([batch[:1]])


@pytest.mark.parametrize(("k", "h", "moment"), [(4, 25, "galaxy"), (8, 10, "galaxy"), (2, 25, "group"),
                                                 (3, 25, "galaxy"), (4, 50, "group")])  # fmt: skip
def test_auto_takes_the_galaxy_moment_for_three_groups_or_more_at_h_up_to_25(k: int, h: int, moment: str) -> None:
    assert auto_inner_moment(h, k) == moment
    cfg = Config.model_validate({"path_model": "m", "fake_data": True, "hv": {"galaxy_size": k, "local_steps": h}})
    assert galaxy_moment(cfg, tokens_per_step=4096, grad_accum=1) == (moment == "galaxy")


def test_auto_under_target_tokens_reads_the_h_of_equal_groups() -> None:
    hv = {"galaxy_size": 4, "target_tokens": 4 * 1000 * 20}  # 20 steps of 1000 tokens per group
    cfg = Config.model_validate({"path_model": "m", "fake_data": True, "hv": hv})
    assert galaxy_moment(cfg, tokens_per_step=1000, grad_accum=1)
    assert not galaxy_moment(cfg, tokens_per_step=100, grad_accum=1)  # H = 200


def test_where_a_step_has_no_halves_auto_keeps_adamw_and_galaxy_refuses() -> None:
    one = {"path_model": "m", "fake_data": True, "per_device_train_batch_size": 1, "total_batch_size": 1}
    auto = Config.model_validate({**one, "hv": {"galaxy_size": 4, "local_steps": 25}})
    assert not galaxy_moment(auto, tokens_per_step=1024, grad_accum=1)
    assert galaxy_moment(auto, tokens_per_step=1024, grad_accum=2)  # two micro-batches: two halves
    explicit = Config.model_validate({**one, "hv": {"galaxy_size": 4, "inner_moment": "galaxy"}})
    with pytest.raises(UsageError, match="--hv.inner-moment galaxy needs two halves"):
        galaxy_moment(explicit, tokens_per_step=1024, grad_accum=1)
    alone = Config.model_validate({"path_model": "m", "fake_data": True, "hv": {"inner_moment": "galaxy"}})
    assert not galaxy_moment(alone, tokens_per_step=1024, grad_accum=1)  # galaxy size 1: no galaxy


def test_zero1_keeps_adamw_under_auto_and_refuses_galaxy() -> None:
    hv = {"galaxy_size": 4, "local_steps": 25}
    cfg = Config.model_validate({"path_model": "m", "fake_data": True, "sharding_strategy": "ZERO1", "hv": hv})
    assert not galaxy_moment(cfg, tokens_per_step=1024, grad_accum=1)
    with pytest.raises(ValueError, match="--hv.inner-moment galaxy needs each rank's whole AdamW state"):
        Config.model_validate({"path_model": "m", "fake_data": True, "sharding_strategy": "ZERO1",
                               "hv": {**hv, "inner_moment": "galaxy"}})  # fmt: skip

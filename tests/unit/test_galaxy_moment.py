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



def halves_run(model: torch.nn.Module, steps: int = 4) -> None:
    """Steps of GalaxyAdamW with each step's variance from two halves, a parameter left out of one step."""
    opt = GalaxyAdamW(model.parameters(), lr=0.01, betas=BETAS, weight_decay=WD, galaxy_batches=3.0)
    halves, g = Halves(model.parameters()), torch.Generator().manual_seed(3)
    for step in range(steps):
        x = torch.randn(4, 6, generator=g)
        model.zero_grad(set_to_none=True)
        model(x[:2]).square().mean().backward()
        halves.snapshot()
        model(x[2:]).square().mean().backward()
        if step == 2:
            model[1].bias.grad = None  # a step that leaves a parameter out: it steps at its own count afterwards
        halves.observe(opt, 0.5, 1.0, 0.8)
        opt.step()


def test_on_fsdp2_shards_it_steps_as_on_whole_tensors(one_process_group: None) -> None:
    """The step and the estimate work on each rank's local shard (elementwise, multi-tensor ops): a model under
    fully_shard ends bit-identical to the same model stepped as plain tensors."""
    from torch.distributed.fsdp import fully_shard

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))

    plain, sharded = model(), model()
    fully_shard(sharded)
    sharded.set_requires_gradient_sync(True)
    halves_run(plain)
    halves_run(sharded)
    for p, q in zip(plain.parameters(), sharded.parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach().full_tensor())



def test_its_multi_tensor_step_is_the_formula_per_parameter() -> None:
    """v = max(E[g²] - (1 - 1/k) E[Var g], E[g²] / k), AdamW otherwise, parameter by parameter: the same bits,
    also for a parameter that missed a step (its own bias correction)."""
    ours, theirs = params(), params()
    opt, k, lr = GalaxyAdamW(ours, lr=0.01, betas=BETAS, weight_decay=WD, galaxy_batches=3.0), 3.0, 0.01
    state = [dict(m=torch.zeros_like(q), v=torch.zeros_like(q), var=torch.zeros_like(q), t=0) for q in theirs]
    gen = torch.Generator().manual_seed(4)
    for step in range(5):
        grads = [torch.randn(q.shape, generator=gen) for q in theirs]
        variance = [g.square() * 0.5 for g in grads]
        skip = 1 if step == 2 else None
        for i, (p, q, g, var, s) in enumerate(zip(ours, theirs, grads, variance, state, strict=True)):
            p.grad = None if i == skip else g.clone()
            if i == skip:
                continue
            with torch.no_grad():
                s["t"] += 1
                q.mul_(1 - lr * WD)
                s["m"].lerp_(g, 1 - BETAS[0])
                s["v"].mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
                s["var"].mul_(BETAS[1]).add_(var, alpha=1 - BETAS[1])
                second = torch.maximum(s["v"] - (1 - 1 / k) * s["var"], s["v"] / k)
                denom = (second / (1 - BETAS[1] ** s["t"])).sqrt_().add_(1e-8)
                q.addcdiv_(s["m"], denom, value=-lr / (1 - BETAS[0] ** s["t"]))
        opt.observe({p: v for p, v in zip(ours, variance, strict=True)})
        opt.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p.detach(), q.detach())


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
    assert auto_inner_moment(h, k, micro_batches=2) == moment
    cfg = Config.model_validate({"path_model": "m", "fake_data": True, "hv": {"galaxy_size": k, "local_steps": h}})
    assert galaxy_moment(cfg, tokens_per_step=4096, grad_accum=2) == (moment == "galaxy")


@pytest.mark.parametrize("k", [3, 4, 8])
def test_auto_splits_no_lone_micro_batch_for_the_galaxy_moment(k: int) -> None:
    """A second pass per step costs more than the moment gains (docs/outer-step.md): one micro-batch, plain AdamW;
    `--hv.inner-moment galaxy` still splits it."""
    assert auto_inner_moment(25, k, micro_batches=1) == "group"
    hv = {"galaxy_size": k, "local_steps": 25}
    cfg = Config.model_validate({"path_model": "m", "fake_data": True, "hv": hv})
    assert not galaxy_moment(cfg, tokens_per_step=4096, grad_accum=1)
    assert galaxy_moment(cfg, tokens_per_step=4096, grad_accum=3)
    forced = Config.model_validate({"path_model": "m", "fake_data": True, "hv": hv | {"inner_moment": "galaxy"}})
    assert galaxy_moment(forced, tokens_per_step=4096, grad_accum=1)


def test_auto_under_target_tokens_reads_the_h_of_equal_groups() -> None:
    hv = {"galaxy_size": 4, "target_tokens": 4 * 1000 * 20}  # 20 steps of 1000 tokens per group
    cfg = Config.model_validate({"path_model": "m", "fake_data": True, "hv": hv})
    assert galaxy_moment(cfg, tokens_per_step=1000, grad_accum=2)
    assert not galaxy_moment(cfg, tokens_per_step=100, grad_accum=2)  # H = 200


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
    assert not galaxy_moment(cfg, tokens_per_step=1024, grad_accum=2)
    with pytest.raises(ValueError, match="--hv.inner-moment galaxy needs each rank's whole AdamW state"):
        Config.model_validate({"path_model": "m", "fake_data": True, "sharding_strategy": "ZERO1",
                               "hv": {**hv, "inner_moment": "galaxy"}})  # fmt: skip

"""The outer step's arithmetic, against hand computation, with an in-memory averager across threads."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from diloco.outer import DiLoCo


def approx(value: float) -> object:
    return pytest.approx(value, rel=1e-6, abs=1e-7)


@dataclass
class Report:
    num_peers: int
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    ok: bool = True


class MeanOfGroups:
    """k groups meet at a barrier; each gets the exact mean of everyone's tensors."""

    def __init__(self, k: int) -> None:
        self.k, self.barrier, self.inbox = k, threading.Barrier(k), {}

    def for_group(self, index: int) -> _Member:
        return _Member(self, index)


class _Member:
    def __init__(self, hub: MeanOfGroups, index: int) -> None:
        self.hub, self.index = hub, index

    def average(self, tensors: Sequence[torch.Tensor], round_index: int) -> Report:
        self.hub.inbox[self.index] = [t.clone() for t in tensors]
        self.hub.barrier.wait()
        for i, tensor in enumerate(tensors):
            tensor.copy_(torch.stack([self.hub.inbox[g][i] for g in range(self.hub.k)]).mean(0))
        self.hub.barrier.wait()
        return Report(num_peers=self.hub.k)

    def shutdown(self) -> None:
        pass


class Alone:
    def average(self, tensors: Sequence[torch.Tensor], round_index: int) -> Report:
        return Report(num_peers=1)

    def shutdown(self) -> None:
        pass


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batches(step: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + group)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def diloco(net: torch.nn.Module, averager: object, lr: float, momentum: float, h: int = 1) -> DiLoCo:
    return DiLoCo(
        [p.data for p in net.parameters()], averager, local_steps=h, outer_lr=lr, outer_momentum=momentum,
        group_sum=lambda v: v, group_sha=lambda: None,
    )  # fmt: skip


def sgd_step(net: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(batch[0]), batch[1]).backward()
    opt.step()


def test_h1_outer_lr1_no_momentum_equals_data_parallel_sgd() -> None:
    """With H=1, inner SGD, outer lr 1 and no momentum, k groups take exactly the data-parallel SGD steps."""
    k, steps, lr = 3, 5, 0.1
    reference = model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    for step in range(steps):  # data-parallel: the gradient of the mean loss over all k batches
        ref_opt.zero_grad()
        for group in range(k):
            x, y = batches(step, group)
            (torch.nn.functional.mse_loss(reference(x), y) / k).backward()
        ref_opt.step()

    hub = MeanOfGroups(k)
    nets = [model() for _ in range(k)]

    def run_group(group: int) -> None:
        net = nets[group]
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        outer = diloco(net, hub.for_group(group), lr=1.0, momentum=0.0)
        for step in range(steps):
            sgd_step(net, opt, batches(step, group))
            row = outer.after_inner_step(step + 1)
            assert row["num_peers"] == k and row["outer_step"] == step + 1

    with ThreadPoolExecutor(k) as pool:
        list(pool.map(run_group, range(k)))
    for net in nets:
        for p, q in zip(net.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(p, q) for p, q in zip(nets[0].parameters(), nets[1].parameters()))


def test_nesterov_outer_step_by_hand() -> None:
    """Alone, two outer steps of SGD with Nesterov momentum m: v = m·v + Δ; θ ← θ − lr·(Δ + m·v)."""
    net = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        net.weight.fill_(1.0)
    outer = diloco(net, Alone(), lr=0.5, momentum=0.9, h=2)
    theta, velocity = 1.0, 0.0
    for new_local in (0.8, None):
        with torch.no_grad():
            net.weight.fill_(new_local if new_local is not None else theta - 0.3)
        delta = theta - net.weight.item()
        assert outer.after_inner_step(1) is None  # not due yet: H = 2
        row = outer.after_inner_step(2)
        velocity = 0.9 * velocity + delta
        theta -= 0.5 * (delta + 0.9 * velocity)
        assert row["num_peers"] == 1 and row["pseudo_grad_norm"] == approx(abs(delta))
        assert net.weight.item() == approx(theta)  # the model was reset to the new outer parameters
    state = outer.state_dict()
    assert state["outer_step"] == 2 and state["outer"].item() == approx(theta)


def test_state_round_trip_restores_momentum() -> None:
    a, b = model(1), model(2)
    outer_a = diloco(a, Alone(), lr=0.7, momentum=0.9)
    with torch.no_grad():
        for p in a.parameters():
            p.add_(0.01)
    outer_a.after_inner_step(1)
    outer_b = diloco(b, Alone(), lr=0.7, momentum=0.9)
    outer_b.load_state_dict(outer_a.state_dict())
    assert torch.equal(outer_b.outer, outer_a.outer) and outer_b.outer_step == 1
    assert torch.equal(
        outer_b.optimizer.state_dict()["state"][0]["momentum_buffer"],
        outer_a.optimizer.state_dict()["state"][0]["momentum_buffer"],
    )

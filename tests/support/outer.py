"""The outer loop on small torch nets, with a member of the in-memory swarm (``diloco.outer.memory``): a DiLoCo
over a net's parameters, and a net of four decoder layers whose parameters fragments can split."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from diloco.outer.diloco import DiLoCo
from diloco.outer.fragments import fragment_params, local_runs
from diloco.outer.links import solo_group
from diloco.outer.memory import Member


def diloco(
    net: torch.nn.Module, swarm: Member, lr: float, momentum: float, h: int = 1, world_rank: int = 0, **kw: Any
) -> DiLoCo:
    return DiLoCo(
        [p.data for p in net.parameters()], swarm, solo_group(), world_rank=world_rank, local_steps=h,
        outer_lr=lr, outer_momentum=momentum, **kw,
    )  # fmt: skip


LAYERS = [None, None, 0, 0, 1, 1, 2, 2, 3, 3, None]  # embedding (weight, bias), 4 layers (w, b), final norm


class Layered(torch.nn.Module):
    """An embedding, four decoder layers and a head: the parameters in the order of `LAYERS`."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(3, 4)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
        self.norm = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return (x * self.norm).sum(-1, keepdim=True)


def runs_of(net: torch.nn.Module, count: int, layout: str = "strided") -> list[list[tuple[int, int]]]:
    return [local_runs(f, [p.numel() for p in net.parameters()]) for f in fragment_params(LAYERS, count, layout)]


def flat(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def batches(step: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group `group`'s regression batch of inner step `step`."""
    g = torch.Generator().manual_seed(1000 * step + group)
    return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)


def train_pair(nets: dict[int, torch.nn.Module], outers: dict[int, DiLoCo], steps: range) -> dict[int, list[dict]]:
    """Two groups, each a thread, train their nets on their own batches (SGD, lr 0.05) over `steps`, each inner
    step followed by its outer loop's `after_inner_step`; returns each group's outer rows."""
    rows: dict[int, list[dict]] = {0: [], 1: []}

    def run_group(group: int) -> None:
        opt = torch.optim.SGD(nets[group].parameters(), lr=0.05)
        for step in steps:
            opt.zero_grad()
            x, y = batches(step, group)
            torch.nn.functional.mse_loss(nets[group](x), y).backward()
            opt.step()
            report = outers[group].after_inner_step(step + 1)
            if report is not None:
                rows[group] += report.rows

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(run_group, (0, 1)))
    return rows

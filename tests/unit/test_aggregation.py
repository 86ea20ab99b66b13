"""Robust aggregation (``--hv.aggregation``): the rules on their own, and inside a real TCP round on loopback."""

from __future__ import annotations

import pytest
import torch

from diloco.outer.memory import PART_NUMEL, MemorySwarm
from diloco.swarm.rounds import tcp
from diloco.swarm.rounds.aggregation import (
    AGGREGATIONS,
    aggregate,
    centered_clip,
    trim_count,
    trimmed_mean,
)
from tests.support.tcp import randn, run_group

torch.set_num_threads(1)


def honest(n: int, numel: int = 2000) -> list[torch.Tensor]:
    """Pseudo-gradients that agree on a direction, each with its own noise (groups' data differ)."""
    direction = randn(numel, 100)
    return [direction + 0.3 * randn(numel, seed) for seed in range(n)]


ATTACKS = {
    "scaled-50x": lambda g: 50 * g,
    "sign-flip": lambda g: -g,
    "noise": lambda g: randn(g.numel(), 99) * g.norm() / g.numel() ** 0.5,
    "huge": lambda g: 1e6 * g,
}


def test_the_mean_is_the_weighted_mean_and_robust_rules_need_three():
    parts, weights = honest(3), [1.0, 2.0, 0.5]
    expected = (parts[0] + 2 * parts[1] + 0.5 * parts[2]) / 3.5
    assert torch.allclose(aggregate(parts, weights, "mean"), expected, atol=1e-6)
    for rule in ("trimmed-mean", "centered-clip"):  # two with a weight: nobody can outvote anybody, the mean
        assert torch.equal(aggregate(parts, [1.0, 1.0, 0.0], rule), aggregate(parts, [1.0, 1.0, 0.0], "mean"))
    assert trim_count(3) == trim_count(9) == 1 and trim_count(10) == 2


def test_the_trimmed_mean_drops_each_coordinates_extremes_with_their_weights():
    stacked = torch.tensor([[1.0, 50.0], [2.0, -3.0], [3.0, 0.0], [100.0, 1.0], [-7.0, 2.0]])
    weights = torch.tensor([1.0, 2.0, 1.0, 1.0, 4.0])
    # column 0 keeps 1, 2, 3 (weights 1, 2, 1); column 1 keeps 0, 1, 2 (weights 1, 1, 4)
    expected = torch.tensor([(1 + 4 + 3) / 4, (0 + 1 + 8) / 6])
    assert torch.allclose(trimmed_mean(stacked, weights), expected)
    assert torch.equal(trimmed_mean(stacked[:3], torch.ones(3)), stacked[:3].median(dim=0).values)  # n = 3


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize("rule", ["trimmed-mean", "centered-clip"])
def test_one_attacker_among_five_barely_moves_a_robust_rule(rule: str, attack: str):
    """Four honest contributions and one attacker: the mean is dragged by the attacker (scaled ones by ~10× the
    honest norm), a robust rule stays within a third of the honest norm of the honest mean, whatever the scale."""
    good = honest(4)
    target = aggregate(good, [1.0] * 4, "mean")
    parts = [*good, ATTACKS[attack](good[0])]
    robust = aggregate(parts, [1.0] * 5, rule)
    assert float((robust - target).norm()) < 0.35 * float(target.norm()), rule
    if attack in ("scaled-50x", "huge"):
        assert float((aggregate(parts, [1.0] * 5, "mean") - target).norm()) > 9 * float(target.norm())


@pytest.mark.parametrize("rule", ["trimmed-mean", "centered-clip"])
def test_a_heavy_attacker_counts_as_the_median_contribution_under_a_robust_rule(rule: str):
    """An attacker announcing the most weight the cap lets through (16 median groups) and sending minus its
    pseudo-gradient: a robust rule counts it as one median contribution, so it stays near the honest mean, where
    the mean follows the attacker."""
    good = honest(4)
    target = aggregate(good, [1.0] * 4, "mean")
    parts, weights = [*good, -good[0]], [1.0, 2.0, 1.0, 1.0, 16.0]
    assert float((aggregate(parts, weights, rule) - target).norm()) < 0.35 * float(target.norm())
    assert float((aggregate(parts, weights, "mean") - target).norm()) > float(target.norm())


def test_centered_clipping_bounds_the_pull_of_one_contribution():
    """However far one contribution lies, it moves the result by at most its share of tau per pass."""
    good = honest(4)
    results = [centered_clip(torch.stack([*good, scale * good[0]]), torch.ones(5)) for scale in (50.0, 1e4, 1e8)]
    assert torch.allclose(results[1], results[2], atol=1e-4) and torch.allclose(results[0], results[1], atol=0.05)


@pytest.mark.parametrize("rule", AGGREGATIONS)
def test_a_tcp_round_combines_by_the_rule_and_every_peer_holds_the_same_bytes(rule: str):
    """Five peers over real sockets, one sending 50× its vector (under the 100× screen): every peer ends with the
    very same bytes, equal to the rule applied part by part to the five inputs."""
    numel = 3 * tcp.RAW.part_numel + 5  # parts of several reducers, the last one short
    vectors = [*honest(4, numel), 50 * honest(1, numel)[0]]
    inputs = [v.clone() for v in vectors]
    outs, errors, rounds, _ = run_group(vectors, aggregation=rule)
    assert errors == [None] * 5 and all(r.rejected == 0 for r in rounds)
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    expected = torch.full((numel,), float("nan"))
    for j, round_ in enumerate(rounds):  # the parts reducer j combined
        for part in round_.schedule.parts[j]:
            lo, hi = round_._bounds(part)
            expected[lo:hi] = aggregate([v[lo:hi] for v in inputs], [1.0] * 5, rule)
    assert torch.equal(outs[0], expected)


def test_the_memory_swarm_combines_part_by_part_as_the_transport_does():
    """The benches' in-memory swarm: tensors laid end to end, cut every PART_NUMEL values, each part combined."""
    shapes = [(PART_NUMEL // 2 + 3,), (3, PART_NUMEL // 2)]
    groups = [[randn(int(torch.Size(s).numel()), 10 * g + i).view(s) for i, s in enumerate(shapes)] for g in range(4)]
    groups.append([100 * t for t in groups[0]])
    swarm = MemorySwarm(5, aggregation="trimmed-mean")
    combined = swarm.combine([(ts, 1.0) for ts in groups])
    flats = [torch.cat([t.reshape(-1) for t in ts]) for ts in groups]
    expected = torch.cat([aggregate([f[lo : lo + PART_NUMEL] for f in flats], [1.0] * 5, "trimmed-mean")
                          for lo in range(0, flats[0].numel(), PART_NUMEL)])  # fmt: skip
    assert [c.shape for c in combined] == [torch.Size(s) for s in shapes]
    assert torch.equal(torch.cat([c.reshape(-1) for c in combined]), expected)

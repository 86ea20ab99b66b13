"""Sparse rounds (``--hv.compression sparse``) between torchrun worker groups of different shapes through a real DHT
on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from tests.integration.test_galaxy import assert_fragment_rounds_shared, assert_trained_together, train_groups
from tests.support.groups import outer_rows
from tests.support.paths import TINY_MODEL

SPARSE = ["--hv.compression", "sparse"]


def tiny_parameters() -> int:
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "p2pd"])
def test_a_one_rank_and_a_two_rank_group_average_sparse_rounds_bit_identically(tmp_path: Path, dht_peer: list[str],
                                                                              transport: str) -> None:  # fmt: skip
    """A 1-rank group and a 2-rank FULL_SHARD group, a quarter of each row sent in 2 bits (the tiny model's rows are
    64 values; in 3 rounds a 64th would barely move it): bit-identical after every round, one final model, and each
    round moves a small share of what float32 would; over TCP and over libp2p streams alike (one round code)."""
    sparse = [*SPARSE, "--hv.sparse-density", "0.25", "--hv.transport", transport]
    run_dirs = train_groups(tmp_path, dht_peer, 12, [(1, sparse), (2, sparse)])
    assert_trained_together(run_dirs, groups=2, outer_steps=3)
    dense = 2 * 4 * tiny_parameters()  # float32: the 1-rank group sends and receives the model once each
    rounds = [r for r in outer_rows(run_dirs[0]) if r.get("num_peers") == 2]
    assert rounds and all(r["bytes_sent"] + r["bytes_received"] < dense / 8 for r in rounds), (dense, rounds)
    assert all(r["transport"] == transport for r in rounds), rounds


@pytest.mark.slow
def test_sparse_fragments_overlapping_the_inner_steps_keep_one_outer_state(tmp_path: Path,
                                                                          dht_peer: list[str]) -> None:  # fmt: skip
    """--hv.fragments 2 --hv.overlap-steps 1 with sparse rounds between a 1-rank group and a 2-rank NO_SHARD group
    (whose replicas split each fragment's exchange on chunk boundaries), under the nesterov rule."""
    own = [*SPARSE, "--hv.sparse-rule", "nesterov", "--hv.fragments", "2", "--hv.overlap-steps", "1"]
    run_dirs = train_groups(tmp_path, dht_peer, 8, [(1, own), (2, [*own, "--sharding-strategy", "NO_SHARD"])])
    assert_fragment_rounds_shared(run_dirs)

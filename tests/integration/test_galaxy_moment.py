"""The inner AdamW with the galaxy's second moment (diloco.galaxy_moment) under torchrun, two ranks: every
sharding strategy takes the same steps."""

from __future__ import annotations

import json

import pytest

from tests.support.paths import CORPUS, ROOT, TORCHRUN
from tests.support.procs import assert_ok, run_cmd


@pytest.mark.slow
def test_every_sharding_strategy_takes_the_same_galaxy_moment_steps(tmp_path) -> None:
    """Two torchrun ranks, a small llama, 3 inner steps of `train.inner_step` with the galaxy's second moment:
    FULL_SHARD (each rank holds shards, the first part's gradient reduce-scattered mid-step), NO_SHARD and DDP
    (replicas) end with the same model but for rounding (the two parts' gradients are reduced in another order),
    and not AdamW's; with k = 1 the halves give AdamW's model; a run resumed from a checkpoint is bit-exact."""
    out = tmp_path / "shas.json"
    worker = ROOT / "tests" / "support" / "galaxy_moment_worker.py"
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(worker), str(out), str(CORPUS)]
    result = run_cmd(cmd, timeout=240)
    assert_ok(result)
    found = json.loads(out.read_text())
    diffs = found["max_diff_to_ddp"]
    assert diffs["FULL_SHARD"] < 1e-5 and diffs["NO_SHARD"] < 1e-5, found  # reduce order: float rounding
    assert diffs["adamw"] > 1e-3, found  # the galaxy moment took other steps than AdamW
    assert found["adamw_k1_to_adamw"] < 1e-4, found  # k = 1 with halves: AdamW's steps, to rounding
    assert found["resumed_diff"] == 0.0, found  # the checkpoint holds the whole optimizer state: bit-exact

"""`diloco bench shapes --quick`: a 1-rank and a 2-rank FULL_SHARD group in one swarm, against two 1-rank groups;
the groups of each arm are identical after every round, and the report says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.paths import DILOCO
from tests.support.procs import assert_ok, run_cmd


@pytest.mark.slow
def test_shapes_quick(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    assert_ok(run_cmd([str(DILOCO), "bench", "shapes", "--quick", "--out", str(tmp_path), "--doc", str(doc)],
                      timeout=400))  # fmt: skip
    data = json.loads((tmp_path / "shapes-quick.json").read_text())
    assert [(arm["name"], arm["ranks"]) for arm in data["arms"]] == [("1+1", [1, 1]), ("1+2", [1, 2])]
    for arm in data["arms"]:
        assert arm["rounds"] and all(r["identical"] for r in arm["rounds"]), arm  # every round had both groups
        assert arm["identical_after_every_round"] and arm["same_final_model"]
        assert arm["outer_steps"] == [2, 2]
        assert all(r["allreduce_s"] > 0 and min(r["mb"]) > 0 for r in arm["rounds"])
    # a group's payload does not depend on its shape: its ranks together send and receive the model once
    equal, mixed = (arm["median_mb_per_group"] for arm in data["arms"])
    assert mixed == pytest.approx(equal, rel=0.05)
    assert data["mixed_over_equal_round_time"] == pytest.approx(
        data["arms"][1]["median_allreduce_s"] / data["arms"][0]["median_allreduce_s"])
    section = doc.read_text()
    shared = len(data["arms"][1]["rounds"])  # (2; under load the first round can miss a group still starting)
    assert f"| 1+2 | 1 + 2 | {shared} | yes | yes |" in section and "Round time of 1+2 ÷ 1+1:" in section
    # the pair of unequal speed (the 1-rank group accumulates two micro-batches) under today's defaults (the full run
    # adds the former ones)
    pair = {arm["name"]: arm for arm in data["pair"]}
    assert list(pair) == ["1+2-defaults"]
    for arm in pair.values():
        assert arm["same_final_model"] and arm["wall_s"] > 0 and arm["swarm_tokens_per_s"] > 0, arm
        for g in arm["groups"]:
            assert g["rounds"] > 0 and 0 <= g["full_rounds"] <= g["rounds"] and g["discarded_steps"] >= 0, g
            assert sum(g["steps_per_round"]) <= g["inner_steps"] and g["step_tokens_per_s"] > g["tokens_per_s"]
    assert pair["1+2-defaults"]["discarded_steps"] == 0, pair  # no inner step thrown away while both live
    assert "--per-device-train-batch-size 1 --total-batch-size 2" in " ".join(data["commands"]["1+2-defaults"])
    assert "**Unequal speed, one swarm**" in section and "| 1+2-defaults | 1 | 2 | " in section
    assert "under today's defaults (no pace flag)" in section

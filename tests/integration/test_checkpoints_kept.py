"""OpenDiLoCo's --ckpt.topk and --attn-implementation in a real run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.procs import FAST, assert_ok, python_train, summary


@pytest.mark.slow
def test_ckpt_topk_keeps_the_newest_checkpoints_and_attn_implementation_builds_the_model(tmp_path: Path) -> None:
    run_dir, ckpts = tmp_path / "run", tmp_path / "ckpt"
    result = python_train([*FAST, "--fake-data", "--total-batch-size", "2", "--max-steps", "6", "--ckpt.interval",
                           "2", "--ckpt.path", str(ckpts), "--ckpt.topk", "2", "--attn-implementation", "eager",
                           "--run-dir", str(run_dir)])  # fmt: skip
    assert_ok(result)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-4", "step-6"]
    assert summary(run_dir)["status"] == "ok"
    # the kernel's name reaches transformers: one it does not know is one line naming the flag, nothing written
    bad = python_train([*FAST, "--fake-data", "--max-steps", "1", "--attn-implementation", "bogus", "--run-dir",
                        str(tmp_path / "bad")])  # fmt: skip
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --attn-implementation bogus:"), bad.stderr
    assert not (tmp_path / "bad").exists()

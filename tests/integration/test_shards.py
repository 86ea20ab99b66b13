"""A 2-rank FSDP group loads a checkpoint with each rank reading only its own shards from the safetensors files
(``diloco.shards``): the group's model is the one ``from_pretrained`` gives, under each sharded strategy. A fresh
model, of which each rank draws its own shards a unit at a time (``diloco.fresh``), is the one a single process draws
from the same seed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from diloco.model import load_model, params_sha256
from tests.support.architectures import write_config
from tests.support.paths import TORCHRUN
from tests.support.procs import FAST, run_cmd, summary

# (model type, weights' dtype or None for no weights (fresh), max_shard_size or None for one file, strategy)
CASES = [
    ("qwen2", None, None, "FULL_SHARD"),  # fresh, tied: each rank draws its own shards
    ("gpt2", None, None, "HYBRID_SHARD"),  # fresh, with GPT-2's residual projections redrawn by their parent modules
    ("llama", torch.float32, None, "FULL_SHARD"),
    ("qwen2", torch.bfloat16, "20KB", "HYBRID_SHARD"),  # tied; several files and their index; a 2-D mesh
    ("gpt2", torch.float32, "20KB", "SHARD_GRAD_OP"),  # tied Conv1D
]


@pytest.mark.slow
def test_each_rank_reads_its_shards_and_the_group_holds_what_one_process_loads(tmp_path: Path) -> None:
    runs, expected = [], []
    for i, (model_type, dtype, shard_size, strategy) in enumerate(CASES):
        folder = write_config(model_type, tmp_path / f"config-{i}")
        if dtype is not None:
            model = load_model(folder, seed=5)
            folder = tmp_path / f"weights-{i}"
            model.to(dtype).save_pretrained(folder, **({"max_shard_size": shard_size} if shard_size else {}))
        reloaded = load_model(folder, seed=0)  # the float32 model from_pretrained makes of the files (or seed 0 draws)
        expected.append(params_sha256(list(reloaded.named_parameters())))
        runs.append([*FAST, "--path-model", str(folder), "--fake-data", "--total-batch-size", "4",
                     "--max-steps", "0", "--eval-steps", "1", "--sharding-strategy", strategy, "--seed", "0",
                     "--run-dir", str(tmp_path / f"run-{i}")])  # fmt: skip
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    result = run_cmd([str(TORCHRUN), "--standalone", "--nproc_per_node=2", "-m", "tests.support.runs",
                      str(tmp_path / "runs.json")], timeout=300)  # fmt: skip
    assert result.returncode == 0, result.output[-3000:]
    assert re.findall(r"^RUN (\d+) EXIT (\d+)$", result.stdout, re.M) == [(str(i), "0") for i in range(len(CASES))]
    for i, sha in enumerate(expected):
        ran = summary(tmp_path / f"run-{i}")
        assert ran["params_sha256"] == sha, CASES[i]
        assert len(ran["startup_host_peak_mb_per_rank"]) == 2

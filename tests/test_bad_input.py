"""Bad input: one line naming the flag or file, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .conftest import FAST, TINY_MODEL, python_train, torchrun

pytestmark = pytest.mark.slow

FAKE = [*FAST, "--fake-data", "--total-batch-size", "4", "--max-steps", "2"]


def corrupt_checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt" / "step-3"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"step": 3, "world_size": 1}))
    (folder / ".metadata").write_bytes(b"truncated")
    (folder / "rank-0.pt").write_bytes(b"")
    return folder


def empty_dataset(tmp_path: Path) -> Path:
    (tmp_path / "empty.txt").write_text("")
    return tmp_path / "empty.txt"


def occupied_run_dir(tmp_path: Path) -> Path:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text('{"step": 1}\n')
    return tmp_path / "old"


CASES = {
    "indivisible batch": (lambda t: ["--total-batch-size", "5"], "--total-batch-size 5"),
    "missing model folder": (lambda t: ["--path-model", str(t / "nope")], "--path-model"),
    "hub id": (lambda t: ["--path-model", "meta-llama/Llama-3-8B"], "local Hugging Face folders only"),
    "folder without config": (lambda t: ["--path-model", str(t)], "no config.json"),
    "missing dataset": (lambda t: ["--no-fake-data", "--dataset", str(t / "none.txt")], "--dataset"),
    "empty dataset": (lambda t: ["--no-fake-data", "--dataset", str(empty_dataset(t))], "the dataset is empty"),
    "no data source": (lambda t: ["--no-fake-data"], "--dataset"),
    "unknown precision": (lambda t: ["--precision", "fp8"], "--precision"),
    "unknown strategy": (lambda t: ["--sharding-strategy", "ZERO4"], "--sharding-strategy"),
    "negative steps": (lambda t: ["--max-steps", "-1"], "--max-steps"),
    "not a number": (lambda t: ["--lr", "fast"], "--lr"),
    "corrupt checkpoint": (lambda t: ["--ckpt.resume", str(corrupt_checkpoint(t))], "corrupt checkpoint"),
    "missing checkpoint": (lambda t: ["--ckpt.resume", str(t / "step-9")], "--ckpt.resume"),
    "no latest checkpoint": (lambda t: ["--ckpt.path", str(t), "--ckpt.resume", "latest"], "no step-N checkpoint"),
    "unknown flag": (lambda t: ["--learning-rate", "1"], "--learning-rate"),
    "bad multiaddr": (lambda t: ["--hv.initial-peers", "/ip4/300.1.1.1/tcp/1"], "--hv.initial-peers"),
    "world rank >= galaxy": (lambda t: ["--hv.galaxy-size", "2", "--hv.world-rank", "2"], "--hv.world-rank"),
    "missing config file": (lambda t: ["--config", str(t / "run.toml")], "--config"),
    "run dir in use": (lambda t: ["--run-dir", str(occupied_run_dir(t))], "already holds a run"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case: str, tmp_path: Path) -> None:
    make_args, expected = CASES[case]
    work = tmp_path / "cwd"
    work.mkdir()
    result = python_train([*FAKE, *make_args(tmp_path)], cwd=work)  # the default run folder would go here
    assert result.returncode == 2, result.output[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert list(work.iterdir()) == []  # nothing written


def test_existing_run_dir_is_left_untouched(tmp_path: Path) -> None:
    old = occupied_run_dir(tmp_path)
    before = (old / "metrics.jsonl").read_bytes()
    assert python_train([*FAKE, "--run-dir", str(old)]).returncode == 2
    assert (old / "metrics.jsonl").read_bytes() == before and sorted(p.name for p in old.iterdir()) == ["metrics.jsonl"]


def test_under_torchrun_only_rank_zero_reports(tmp_path: Path) -> None:
    """torchrun reports a failed child itself (exit 1, its own summary), but our line appears once."""
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    result = torchrun([*FAKE, "--path-model", str(model), "--total-batch-size", "6"])
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert ours == ["error: --total-batch-size 6 is not a multiple of --per-device-train-batch-size 2 × 2 ranks = 4"]

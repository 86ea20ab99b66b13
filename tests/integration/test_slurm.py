"""`diloco slurm`'s sbatch script, read by bash."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from diloco.cli import app as cli
from tests.support.paths import TINY_MODEL

TRAIN = [
    "--path-model", str(TINY_MODEL), "--fake-data", "--seq-length", "32", "--per-device-train-batch-size", "2",
    "--total-batch-size", "16", "--max-steps", "8", "--hv.local-steps", "4",
]  # fmt: skip


def slurm_script(capsys: pytest.CaptureFixture[str], tmp_path: Path, *flags: str, train: list[str] = TRAIN) -> str:
    assert cli.run_app(cli.build_app(), ["slurm", "--output", str(tmp_path / "out"), *flags, "--", *train]) == 0
    return capsys.readouterr().out


def test_the_script_is_valid_bash_and_o_writes_it_to_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    assert slurm_script(capsys, tmp_path, "-o", str(path)) == ""
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert (tmp_path / "out").is_dir()  # sbatch's --output folder: Slurm would not create it

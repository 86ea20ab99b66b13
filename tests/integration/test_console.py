"""The console's help text, as the `diloco` command prints it."""

from __future__ import annotations

import subprocess

from tests.support.paths import DILOCO
from tests.support.procs import child_env


def test_help_shows_angle_bracket_defaults_literally() -> None:
    help_text = subprocess.run(
        [str(DILOCO), "train", "--help"], capture_output=True, text=True, env=child_env() | {"COLUMNS": "200"}
    ).stdout
    assert "runs/<run name>/worker-<hv.world-rank>" in help_text
    assert "<run-dir>/checkpoints" in help_text

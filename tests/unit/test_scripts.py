"""The scripts in bin/: what their comments claim about the trainer's choices."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from diloco.outer.auto import outer_setting
from tests.support.parse import parse
from tests.support.paths import ROOT


def trainer_flags(script: Path) -> list[str]:
    """The flags a bin/ script passes to the trainer: everything after the `--` of its `diloco launch` line."""
    text = script.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if "diloco launch" in line and not line.startswith("#"))
    words = shlex.split(line)
    return [word for word in words[words.index("--") + 1 :] if word != '"$@"' and word != "$@"]


def test_the_demos_comment_says_what_auto_picks_for_it() -> None:
    flags = trainer_flags(ROOT / "bin" / "demo")
    config = parse([*flags, "--hv.galaxy-size", "2"])
    tokens = config.total_batch_size * config.seq_length
    picked = outer_setting(config, tokens, config.max_steps)
    said = re.search(r"auto picks lr ([\d.]+), no momentum, warm-up over (\d+) outer steps",
                     (ROOT / "bin" / "demo").read_text())  # fmt: skip
    assert said, "bin/demo no longer says what auto picks"
    assert (float(said[1]), 0.0, int(said[2])) == (picked.lr, picked.momentum, picked.warmup)

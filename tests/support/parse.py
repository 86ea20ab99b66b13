"""The training flags parsed in process, as `python -m diloco.train` parses them (no torch.distributed)."""

from __future__ import annotations

import pytest

from diloco.cli.app import build_app, run_app
from diloco.config import Config


def parse(argv: list[str]) -> Config:
    """What the train command would receive."""
    seen: list[Config] = []
    app = build_app(train_only=True, train_fn=lambda config: seen.append(config) or 0)
    assert run_app(app, argv) == 0
    return seen[0]


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`python -m diloco.train argv`'s flag checks, in process: they must exit 2 with one `error:` line; returns it."""
    with pytest.raises(SystemExit) as exited:
        run_app(build_app(train_only=True, train_fn=lambda config: 0), argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err

"""Fixtures shared by every test; the helpers they use live in ``tests/support``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.parse import usage_error  # noqa: F401  (re-exported until every test imports tests.support)
from tests.support.paths import CORPUS, DILOCO, ROOT, TINY_MODEL, TORCHRUN  # noqa: F401
from tests.support.procs import (  # noqa: F401
    FAST,
    Result,
    assert_ok,
    child_env,
    metrics,
    owned,
    python_train,
    read_until,
    run_cmd,
    stop_group,
    summary,
    torchrun,
)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"

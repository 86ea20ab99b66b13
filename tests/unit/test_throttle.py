"""`diloco.bench.throttle.CpuLimit`'s refusals, before any cgroup is made. Limits on real processes are
tests/integration/test_throttle.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.bench.throttle import CpuLimit, ThrottleError


def test_a_missing_controller_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ThrottleError, match=r"no cgroup v1 cpu controller at .*nothing"):
        with CpuLimit("test-missing", 0.25, root=tmp_path / "nothing"):
            pass
    with pytest.raises(ValueError, match="at least"):
        CpuLimit("test-tiny", 0.001)
    with pytest.raises(ValueError, match="letters, digits"):
        CpuLimit("no/slashes", 0.5)

"""`diloco bench NAME --quick` run as a command, its JSON result and markdown report read back."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.paths import DILOCO
from tests.support.procs import assert_ok, run_cmd

# On a timeout a bench gets SIGTERM and this long to stop its processes (some in sessions or network namespaces of
# their own, out of reach of a SIGKILL to its group) and remove its namespaces and temp folder.
STOP_GRACE_S = 30.0


def bench(name: str, tmp_path: Path, *flags: str, timeout: float = 300, stem: str = "") -> tuple[dict, str]:
    doc = tmp_path / "benchmarks.md"
    command = [str(DILOCO), "bench", name, "--quick", *flags, "--out", str(tmp_path), "--doc", str(doc)]
    result = run_cmd(command, timeout=timeout, term_grace_s=STOP_GRACE_S)
    assert_ok(result)
    return json.loads((tmp_path / f"{stem or name}-quick.json").read_text()), doc.read_text()

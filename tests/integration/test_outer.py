"""The outer loop's imports, seen from a fresh interpreter: it talks to a protocol, not to hivemind."""

from __future__ import annotations

import subprocess
import sys

# ---------------------------------------------------------------- catching up with the swarm


def test_the_outer_loop_and_its_stand_in_swarm_never_import_hivemind() -> None:
    """Only diloco/swarm/*'s network modules import hivemind; the outer loop talks to a protocol."""
    code = "import sys, diloco.outer.diloco, diloco.swarm, diloco.outer.memory; print(sorted(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "'torch'" in loaded and "hivemind" not in loaded

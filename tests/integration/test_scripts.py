"""The scripts in bin/ on a fresh clone: they set up before they run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.support.paths import ROOT


def test_bin_launch_sets_up_a_fresh_clone_before_it_launches(tmp_path: Path) -> None:
    """A fresh clone has no .venv: bin/launch must make it (bin/setup) before it calls .venv/bin/diloco. Here a
    stand-in bin/setup makes a .venv whose diloco prints its arguments."""
    clone = tmp_path / "clone"
    (clone / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "bin" / "launch", clone / "bin" / "launch")
    (clone / "bin" / "setup").write_text(
        "#!/usr/bin/env bash\nset -e\ncd \"$(dirname \"$0\")/..\"\nmkdir -p .venv/bin\n"
        "printf '#!/usr/bin/env bash\\necho diloco \"$@\"\\n' > .venv/bin/diloco\nchmod +x .venv/bin/diloco\n"
    )
    (clone / "bin" / "setup").chmod(0o755)
    done = subprocess.run([str(clone / "bin" / "launch"), "--workers", "2", "--", "--fake-data"], capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "diloco launch --workers 2 -- --fake-data"

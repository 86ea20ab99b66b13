"""A stranger's forged state served under the digest of the real one, against real trainer groups over a real DHT:
no group adopts it (``diloco.outer.catchup``: a download is taken only when it is the state its owner's record
names)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.forged_state import LEAD
from tests.support.groups import finish, group_args, outer_rows, start_group
from tests.support.paths import ROOT
from tests.support.procs import FAST, child_env, summary
from tests.support.swarm import kill_group


def start_stranger(args: list[str], peers: list[str], log: Path) -> subprocess.Popen[str]:
    """A `tests.support.forged_state` process (RUN_ID TARGET WORLD_RANK SECONDS, model FAST's) in its own session,
    output to `log`."""
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.support.forged_state", str(FAST[1]), *args, *peers], cwd=ROOT,
            env=child_env(), stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip


def wait_for_line(log: Path, line: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while line not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None, f"the stranger exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {line!r}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_forged_state_served_under_the_real_digest_is_never_adopted(tmp_path: Path, dht_peer: list[str]) -> None:
    """Two groups train in an open swarm. Once group 0's record is out, a stranger keeps a settled record of its own
    claiming group 0's digest 1000 outer steps ahead, and serves a forged state whose metadata adds up (the claimed
    outer step, the forged values' own digest). Both groups ask it first (the highest outer step), refuse what it
    serves (its digest is not the one its record names), count it, and skip it after three tries; they end on one
    model of their own outer steps, never the stranger's."""
    dirs, logs = [tmp_path / f"w{i}" for i in range(2)], [tmp_path / f"w{i}.log" for i in range(3)]
    steps = ["--max-steps", "40", "--hv.run-id", "forged-state"]
    stranger = start_stranger(["forged-state", "0", "2", "600"], dht_peer, logs[2])
    procs: list[subprocess.Popen] = []
    try:
        wait_for_line(logs[2], "watching for the record of group 0", stranger, 120)
        procs = [start_group(group_args(i, 2, dht_peer, dirs[i], *steps), logs[i]) for i in (0, 1)]
        finish(procs, logs[:2], timeout=420)
    finally:
        for proc in [*procs, stranger]:
            kill_group(proc)
    finals, said = [summary(d) for d in dirs], [log.read_text() for log in logs]
    assert "published a record of outer step" in said[2] and "answered state download 1 " in said[2], said[2][-2000:]
    assert all(s["status"] == "ok" for s in finals), finals
    assert all(1 <= s["rejected_states"] <= 3 for s in finals), finals  # (`catchup.REFUSALS_BEFORE_SKIP`)
    refused = "could not load the state of worker group 2 (it served another digest than its record names)"
    assert all(refused in text for text in said[:2])
    rows = [outer_rows(d) for d in dirs]
    assert all(row["outer_step"] < LEAD and row.get("loaded_state_from") != 2 for r in rows for row in r)
    assert all(0 < s["outer_steps"] < LEAD for s in finals), finals
    assert len({s["params_sha256"] for s in finals}) == 1

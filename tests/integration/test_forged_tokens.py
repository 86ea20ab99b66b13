"""A stranger's round-token records (``--hv.target-tokens``) against a real group: a record of 10**15 tokens counts
at most ``budget.OTHERS_CAP`` times the group's own tokens, and a record claiming outer step 10**6 that no progress
record backs sends it to no round, so its rounds come no sooner than that bound lets them (not at every inner step)
and its run is not cut down to a step per outer step."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.swarm.records.budget import OTHERS_CAP
from tests.support.groups import outer_rows, start_group
from tests.support.paths import ROOT
from tests.support.procs import FAST, child_env, summary
from tests.support.swarm import kill_group

TOKENS_PER_STEP = 64  # 2 sequences of 32 tokens
TARGET = 3264  # N: 17 inner steps of an average group of a galaxy of 3 (3264 / (3 x 64)), 51 of a group alone
MAX_STEPS = 34  # two outer steps


def wait_for_line(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    """Wait until `proc` wrote `text` to `path`; fail if it exits first or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while text not in (path.read_text() if path.exists() else ""):
        assert proc.poll() is None, path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"timed out waiting for {text!r}"
        time.sleep(0.1)


@pytest.mark.slow
def test_forged_token_records_neither_hurry_a_groups_rounds_nor_end_its_run_early(
    tmp_path: Path, dht_peer: list[str]
) -> None:
    """A stranger stores, every half second under its own key, records of 10**15 tokens at the group's outer step
    for world rank 1 (in the galaxy of 3) and 3 .. 19 (outside it), and one of outer step 10**6 for world rank 2.
    Counted as they claim, every inner step would end a round and the run would end after two. The 2-rank group
    (torchrun), alone in its galaxy, counts world rank 1 as at most 8 times its own tokens and nothing of the
    others, so a round comes once its own tokens reach N / 9 (6 inner steps), never sooner, and it takes the run's
    two outer steps after at least 12 inner steps."""
    attacker_log, log, run_dir = tmp_path / "stranger.log", tmp_path / "group.log", tmp_path / "group"
    with attacker_log.open("w") as out:
        attacker = subprocess.Popen(
            [sys.executable, "-m", "tests.support.forged_tokens", "tokens", "600", *dht_peer], cwd=ROOT,
            env=child_env(), stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
    group = None
    try:
        wait_for_line(attacker_log, "forged token records 1:", attacker, 120)
        args = [*FAST, "--fake-data", "--total-batch-size", "2", "--per-device-train-batch-size", "1",
                "--log-interval", "1", "--max-steps", str(MAX_STEPS), "--hv.target-tokens", str(TARGET),
                "--hv.matchmaking-time", "2", "--hv.averaging-timeout", "10", "--hv.run-id", "tokens",
                "--hv.galaxy-size", "3", "--hv.world-rank", "0", "--hv.initial-peers", *dht_peer,
                "--run-dir", str(run_dir)]  # fmt: skip
        group = start_group(args, log, torchrun=True, ranks=2)
        assert group.wait(timeout=300) == 0, log.read_text()[-3000:]
        assert "forged token records" in attacker_log.read_text().splitlines()[-1], attacker_log.read_text()[-2000:]
    finally:
        for proc in (group, attacker):
            if proc is not None:
                kill_group(proc)
    rows = outer_rows(run_dir)
    final = summary(run_dir)
    cap_steps = math.ceil(TARGET / (1 + OTHERS_CAP) / TOKENS_PER_STEP)  # 6: its own tokens, world rank 1 at the cap
    assert final["status"] == "ok" and final["outer_steps"] == 2 and len(rows) == 2, (final, rows)
    assert all(row["tokens"] >= cap_steps * TOKENS_PER_STEP for row in rows), rows
    assert all(row["swarm_tokens"] <= (1 + OTHERS_CAP) * row["tokens"] for row in rows), rows
    assert final["steps"] >= 2 * cap_steps, final

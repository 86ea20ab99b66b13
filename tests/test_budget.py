"""The swarm-wide token budget with real processes: two worker groups on loopback, one throttled by the kernel
(a cgroup CPU quota), averaging through a real DHT."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

from diloco.throttle import CpuLimit

from .conftest import metrics, read_until, summary
from .test_galaxy import TEXT, dht_peer, kill_group, outer_rows, spawn  # noqa: F401 - dht_peer is a fixture

pytestmark = pytest.mark.slow

TOKENS_PER_STEP = 4 * 64  # --total-batch-size 4 × --seq-length 64 (TEXT)
MATCHMAKING_S = 3.0  # what forming a group costs beyond waiting for the others (hivemind's requests)


def step_seconds(run_dir: Path) -> float:
    """The group's median inner-step time while it trained."""
    return statistics.median(TOKENS_PER_STEP / r["tokens_per_s"] for r in metrics(run_dir) if "tokens_per_s" in r)


def test_a_throttled_group_trains_fewer_steps_and_nobody_waits_for_it(tmp_path: Path, dht_peer: list[str]) -> None:
    """Group 1 gets a third of a core once it trains; under --hv.target-tokens group 0 runs more inner steps per
    round instead of waiting, each round weighs the groups by their tokens, and both end on one model."""
    run_dirs = [tmp_path / f"w{i}" for i in range(2)]
    procs = []
    for world_rank, run_dir in enumerate(run_dirs):
        args = [*TEXT, "--total-batch-size", "4", "--max-steps", "12", "--hv.target-tokens", str(2 * 4 * TOKENS_PER_STEP),
                "--hv.galaxy-size", "2", "--hv.world-rank", str(world_rank), "--hv.initial-peers", *dht_peer,
                "--run-dir", str(run_dir)]  # fmt: skip
        procs.append(spawn([sys.executable, "-m", "diloco.train", *args]))
    try:
        with CpuLimit("test-slow-group", 0.33) as limit:
            read_until(procs[1], r"found 2 of 2 worker groups", timeout=180)
            limit.add(procs[1].pid)  # its averager and p2pd too: start-up (imports) ran at full speed
            outputs = [p.communicate(timeout=300)[0] for p in procs]
            throttled = limit.usage().throttled_s
    finally:
        for p in procs:
            kill_group(p)
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    assert throttled > 0  # the kernel really held group 1 back
    finals = [summary(d) for d in run_dirs]
    assert finals[0]["params_sha256"] == finals[1]["params_sha256"]
    assert finals[0]["outer_steps"] == finals[1]["outer_steps"] >= 2
    assert finals[0]["steps"] > finals[1]["steps"], finals  # the fast group trained more inner steps
    rounds = [{r["outer_step"]: r for r in outer_rows(d) if r.get("num_peers") == 2} for d in run_dirs]
    shared = sorted(set(rounds[0]) & set(rounds[1]))
    assert shared, rounds
    fast_step_s, slow_step_s = step_seconds(run_dirs[0]), step_seconds(run_dirs[1])
    for outer_step in shared:
        fast, slow = rounds[0][outer_step], rounds[1][outer_step]
        assert fast["tokens"] > slow["tokens"] > 0, (fast, slow)
        assert fast["weight"] == fast["tokens"] and slow["weight"] == slow["tokens"]
        assert fast["outer_digest"] == slow["outer_digest"]
        # nobody waits for the other longer than one of its inner steps, beyond forming the group
        assert fast["wait_s"] <= slow_step_s + MATCHMAKING_S, (fast, slow_step_s)
        assert slow["wait_s"] <= fast_step_s + MATCHMAKING_S, (slow, fast_step_s)

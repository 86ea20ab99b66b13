"""`diloco bench churn`: its schedule and counters on their own, and a quick soak with real trainers, kills and
restarts on loopback."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from diloco.bench.churn import Life, churn_setup, schedule, stacks_and_tail
from diloco.bench.churn_report import by_end, divergences, life_figures, rss_growth
from tests.support.bench import bench


def test_the_schedule_is_seeded_and_long_enough() -> None:
    setup = churn_setup(quick=False)
    plan = schedule(setup)
    assert plan == schedule(setup) and plan != schedule(setup, seed=1)
    assert len(plan) >= 90 and plan[-1][0] >= setup.soak_s
    gaps = [b[0] - a[0] for a, b in zip(plan, plan[1:])]
    assert min(gaps) >= 10 - 0.01 and max(gaps) <= 30 + 0.01


def life(tmp_path: Path, group: int, rows: list[dict], end: str = "exit", ended_at: float | None = None) -> Life:
    run_dir = tmp_path / f"g{group}-{len(list(tmp_path.iterdir()))}"
    run_dir.mkdir()
    text = "".join(json.dumps(row) + "\n" for row in rows)
    (run_dir / "metrics.jsonl").write_text(text + '{"step": 99, "lo')  # a kill leaves half a line
    proc = subprocess.Popen(["true"])
    proc.wait()
    return Life(group, 0, "start", run_dir, run_dir / "log", proc, 0.0, ended_at=ended_at, end=end)


def round_row(step: int, t: float, round_id: str, digest: str, peers: int = 2) -> dict:
    return {"step": step, "outer_step": step // 2, "num_peers": peers, "round": round_id, "outer_digest": digest,
            "time": t}  # fmt: skip


def test_a_round_whose_members_hold_different_digests_is_a_divergence(tmp_path: Path) -> None:
    a = life(tmp_path, 0, [round_row(2, 1.0, "r1", "x"), round_row(4, 2.0, "r2", "y")])
    b = life(tmp_path, 1, [round_row(2, 1.0, "r1", "x"), round_row(4, 2.0, "r2", "z")])
    c = life(tmp_path, 2, [round_row(4, 2.0, "r3", "w"), round_row(6, 3.0, "r4", "q", peers=0)])  # another round
    named, bad, which = divergences([a, b, c])
    assert (named, bad) == (3, 1) and which[0]["round"] == "r2"
    assert which[0]["rows"]["1"]["step"] == 4 and which[0]["rows"]["1"]["life_dir"] == b.run_dir.name
    assert divergences([a, c])[1] == 0


def test_throughput_counts_what_a_round_took_in_and_the_time_until_the_kill(tmp_path: Path) -> None:
    steps = [{"step": s, "loss": 1.0, "tokens_per_s": 100.0, "time": float(s)} for s in range(1, 8)]
    rows = [*steps[:2], round_row(2, 2.1, "r1", "x"), *steps[2:4], round_row(4, 4.1, "r2", "x"), *steps[4:]]
    killed = life_figures(life(tmp_path, 2, rows, end="kill-9", ended_at=9.1), tokens_per_step=10)
    # from its first round (2.1 s) to the kill (9.1 s); steps 3 and 4 made it into a round, 5-7 were thrown away
    assert killed["committed_tokens"] == 20 and killed["live_s"] == pytest.approx(7.0)
    assert killed["rounds"] == {"ok": 2, "alone": 0, "failed": 0, "sat_out": 0}
    behind = life_figures(life(tmp_path, 1, [round_row(2, 2.1, "", "x", peers=0) | {"sat_out": True}]), 10)
    assert behind["rounds"] == {"ok": 0, "alone": 0, "failed": 1, "sat_out": 1}  # a round sat out applied nothing
    ended = life_figures(life(tmp_path, 0, rows), tokens_per_step=10)
    assert ended["live_s"] == pytest.approx(2.0)  # an exit: until its last round


# a rank: dumps its stacks on SIGUSR1 (as diloco.train does) and sleeps; the launcher: starts one and waits
RANK = ("import faulthandler, signal, time; faulthandler.register(signal.SIGUSR1, all_threads=True); "
        "print('rank up', flush=True); time.sleep(60)")  # fmt: skip
LAUNCHER = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {RANK!r}, '-m', 'diloco.train'])"


def test_a_hang_record_holds_the_ranks_stacks_and_leaves_the_launcher_alone(tmp_path: Path) -> None:
    """SIGUSR1 goes to the ranks (their stacks land in the life's log), not to a torchrun-like launcher, whose
    command names diloco.train too and which the signal would end."""
    log_path = tmp_path / "life0.log"
    with log_path.open("w") as log:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, "-m", "torch.distributed.run", "-m",
                                     "diloco.train"], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    started = [psutil.Process(launcher.pid)]
    try:
        deadline = time.monotonic() + 30
        while "rank up" not in log_path.read_text():
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.1)
        started += started[0].children()
        hung = Life(2, 0, "fresh", tmp_path, log_path, launcher, time.time())
        tail = stacks_and_tail(hung)
        assert any("most recent call first" in line for line in tail), tail
        assert launcher.poll() is None  # still running: the bench kills it itself when it must
    finally:
        for proc in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        launcher.wait()


def test_throughput_is_split_by_how_each_life_ended() -> None:
    """Killed lives trained steps after their last round that no round took: their rate falls below the
    survivors', which is where churn's cost shows."""
    lives = [
        {"end": "exit", "live_s": 100.0, "committed_tokens": 100 * 10, "inner_steps": 102},
        {"end": "exit", "live_s": 100.0, "committed_tokens": 90 * 10, "inner_steps": 90},
        {"end": "kill-9", "live_s": 10.0, "committed_tokens": 5 * 10, "inner_steps": 8},
    ]
    split = by_end(lives, tokens_per_step=10, baseline_tokens_per_s=10.0)
    assert split["exit"]["lives"] == 2 and split["exit"]["uncounted_steps"] == 2
    assert split["exit"]["tokens_per_s"] == pytest.approx(9.5) and split["exit"]["retained"] == pytest.approx(0.95)
    assert split["kill-9"]["retained"] == pytest.approx(0.5) and split["kill-9"]["uncounted_steps"] == 3
    assert by_end(lives, 10, None)["exit"]["retained"] is None


def test_rss_growth_is_the_end_against_the_sample_nearest_the_reference() -> None:
    samples = [(0.0, 100.0), (290.0, 200.0), (310.0, 400.0), (900.0, 230.0)]
    growth = rss_growth(samples, reference_s=300.0)
    assert growth["reference_mb"] == 200.0 and growth["growth"] == pytest.approx(0.15)
    assert rss_growth(samples[:1], 300.0) is None


@pytest.mark.slow
def test_churn_quick(tmp_path: Path) -> None:
    """Three real groups, one killed, stopped, restarted and rejoining on the schedule: nothing diverges or hangs,
    no helper outlives a kill, and every group ends on one model."""

    data, doc = bench("churn", tmp_path, timeout=480)
    soak = data["soak"]
    assert len(data["events"]) >= 4 and data["verdicts"]["events"]
    assert {e["action"] for e in data["events"]} & {"kill-9", "sigterm"}
    assert {e["action"] for e in data["events"]} & {"restart", "fresh"}
    # a str, not the list: pytest would cut a list's repr at 240 characters (as it did on CI, hiding the rows)
    assert soak["divergences"] == 0 and soak["rounds_named"] >= 10, json.dumps(soak["divergent_rounds"], indent=1)
    hangs = soak["hangs"] + data["baseline"]["hangs"]
    assert hangs == [] and soak["orphans"] == [], "\n".join(f"{h['what']}:\n" + "\n".join(h["log_tail"]) for h in hangs)
    assert soak["one_final_model"] and data["baseline"]["one_final_model"]
    assert len({g["params_sha256"] for g in soak["groups"]}) == 1
    churned = [x for x in soak["lives"] if x["group"] == 2]
    assert len(churned) >= 3 and churned[-1]["end"] == "exit"
    assert soak["rounds"]["ok"] > 0 and data["throughput_retained"] > 0
    assert all(len(samples) >= 3 for samples in soak["rss_mb"].values())
    assert (tmp_path / "churn-quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## churn (quick): " in doc and "| soak | " in doc and "throughput retained" in doc

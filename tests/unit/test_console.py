"""The console: progress lines, the start-up banner, and the verdict `diloco launch` ends with."""

from __future__ import annotations

import io
import json
from pathlib import Path

from diloco.console import ProgressLine, banner, count, duration, read_group, verdict


def test_train_rows_are_one_short_line_with_the_eta_from_the_pace_so_far() -> None:
    line = ProgressLine(max_steps=100)
    row = {"step": 10, "loss": 2.61234, "lr": 3e-3, "tokens_per_s": 9120.0, "peak_memory_mb": 310.0, "time": 1.0}
    assert line.format(row, now=50.0) == "step 10/100 | loss 2.6123 | lr 3.00e-03 | 9.12k tok/s"
    # 20 steps in 40 s: 2 s a step, 70 steps to go
    assert line.format(row | {"step": 30}, now=90.0).endswith("| ETA 2m20s")
    assert "ETA" not in line.format(row | {"step": 100}, now=95.0)  # done: nothing left to estimate


def test_a_reader_that_went_away_stops_the_lines_not_the_training() -> None:
    """`python -m diloco.train ... | head`: once `head` exits, a write raises BrokenPipeError. The sink prints
    nothing more and raises nothing (the metrics file still gets every row)."""

    class Closed(io.StringIO):
        def write(self, text: str) -> int:
            self.tries = getattr(self, "tries", 0) + 1
            raise BrokenPipeError(32, "Broken pipe")

    out = Closed()
    line = ProgressLine(max_steps=100, out=out)
    row = {"step": 10, "loss": 2.6, "lr": 3e-3, "tokens_per_s": 9120.0, "peak_memory_mb": 310.0, "time": 1.0}
    line.write(row)
    line.write(row | {"step": 11})
    assert line.gone and out.tries == 1


def test_outer_rows_say_what_the_round_did_without_digests() -> None:
    line = ProgressLine(max_steps=100)
    ok = {"step": 25, "outer_step": 1, "num_peers": 2, "averaging_s": 0.4123, "bytes_sent": 600_000,
          "bytes_received": 600_000, "rejected": 0, "transport": "tcp", "params_sha256": "ab" * 32,
          "outer_digest": "cd" * 32}  # fmt: skip
    assert line.format(ok, now=0.0) == "outer step 1 | peers 2 | 0.41 s | 1.2 MB | tcp"
    assert line.format(ok | {"num_peers": 1, "transport": ""}, now=0.0).startswith("outer step 1 | alone |")
    failed = line.format(ok | {"num_peers": 0, "rejected": 1}, now=0.0)  # (outer step 1 stays: it was for step 2)
    assert failed == "outer step 2 | round failed: nothing applied | rejected 1 | tcp"
    sat_out = line.format(ok | {"num_peers": 1, "sat_out": True, "transport": ""}, now=0.0)
    assert sat_out.startswith("outer step 2 | sat out (the swarm was past it): nothing applied | 0.41 s |"), sat_out
    loaded = {"step": 50, "outer_step": 2, "loaded_state_from": 1, "params_sha256": "ab" * 32}
    assert line.format(loaded, now=0.0) == "outer step 2 | loaded the state of group 1"
    assert line.format(loaded | {"discarded_steps": 0}, now=0.0) == "outer step 2 | loaded the state of group 1"
    assert line.format(loaded | {"discarded_steps": 12}, now=0.0) == (
        "outer step 2 | loaded the state of group 1 | lost 12 steps"
    )
    assert line.format(ok | {"num_peers": 0, "discarded_steps": 1}, now=0.0) == (
        "outer step 2 | round failed: nothing applied | tcp | lost 1 step"
    )
    assert line.format({"step": 50, "eval_loss": 2.5, "eval_perplexity": 12.18}, 0.0) == (
        "step 50/100 | eval loss 2.5000 | ppl 12.18"
    )


def test_banner_and_counts() -> None:
    text = banner({"run dir": "runs/x/worker-0", "model": "1.13M parameters"})
    assert text.splitlines() == ["  run dir : runs/x/worker-0", "  model   : 1.13M parameters"]
    assert [count(n) for n in (999, 1234, 1_130_000, 2.5e9)] == ["999", "1.23k", "1.13M", "2.5G"]
    assert [duration(s) for s in (5, 75, 3725)] == ["5s", "1m15s", "1h02m"]


def write_group(
    folder: Path, sha: str | None, peers: list[int], status: str = "ok", discarded: int | None = None
) -> None:
    folder.mkdir(parents=True)
    rows = [{"step": 1, "loss": 5.0}] + [{"step": 5 * (i + 1), "outer_step": i, "num_peers": p} for i, p in
                                          enumerate(peers)]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"status": status, "steps": 20, "outer_steps": 4, "final_eval_loss": 2.51234, "params_sha256": sha}
    if discarded is not None:  # trainers before the count wrote none
        summary |= {"discarded_steps": discarded, "discarded_tokens": 128 * discarded}
    (folder / "summary.json").write_text(json.dumps(summary))


def test_verdict_counts_rounds_and_says_whether_the_models_match(tmp_path: Path) -> None:
    write_group(tmp_path / "worker-0", "a" * 64, [2, 1, 0, 2])
    write_group(tmp_path / "worker-1", "a" * 64, [2, 2, 2, 2])
    table = verdict([read_group(tmp_path / f"worker-{i}") for i in range(2)])
    lines = table.splitlines()
    assert [cell.strip() for cell in lines[0].split("|")] == ["group", "status", "inner steps", "lost steps",
                                                              "outer steps", "rounds ok/alone/failed",
                                                              "final eval loss", "model"]  # fmt: skip
    # a summary without the count (an earlier trainer): "-"
    assert [cell.strip() for cell in lines[2].split("|")] == ["worker-0", "ok", "20", "-", "4", "2/1/1", "2.5123",
                                                              "a" * 12]  # fmt: skip
    assert "2/1/1" in lines[2] and "4/0/0" in lines[3]
    assert lines[-1].startswith("✓ all 2 worker groups ended with the same model")

    write_group(tmp_path / "worker-2", "b" * 64, [2])
    (tmp_path / "worker-3").mkdir()  # a group that wrote nothing (it crashed at start)
    table = verdict([read_group(tmp_path / f"worker-{i}") for i in range(4)])
    assert "worker-3 | no summary" in table
    assert table.splitlines()[-1] == (
        f"✗ the worker groups did not end with the same model (worker-0, worker-1: {'a' * 12}; "
        f"worker-2: {'b' * 12}; worker-3: none)"
    )


def test_verdict_gives_each_group_s_lost_steps_and_names_those_over_10_percent(tmp_path: Path) -> None:
    for i, discarded in enumerate([0, 2, 3, None]):  # of 20 inner steps: 0%, 10% (not over), 15%, unknown
        write_group(tmp_path / f"worker-{i}", "a" * 64, [2, 2], discarded=discarded)
    groups = [read_group(tmp_path / f"worker-{i}") for i in range(4)]
    assert [g.discarded_steps for g in groups] == [0, 2, 3, None]
    lines = verdict(groups).splitlines()
    assert [line.split("|")[3].strip() for line in lines[2:6]] == ["0", "2 (10%)", "3 (15%)!", "-"]
    assert lines[6:] == [
        "! worker-2 discarded 3 of 20 inner steps (15%): it loaded another group's state over its own work, or a "
        "round applied nothing (see docs/reliability.md)",
        f"✓ all 4 worker groups ended with the same model (params_sha256 {'a' * 12}…)",
    ]

    lines = verdict(groups[:2] + groups[3:]).splitlines()  # at or under 10%: no line
    assert not any(line.startswith("!") for line in lines) and len(lines) == 6
    assert lines[-1].startswith("✓ all 3 worker groups ended with the same model")

"""`diloco bench hetero`: three throttled worker groups alone and in two swarm arms; every figure in the JSON, the
report, the plot, and no cgroup or process left, also when a phase fails. Needs root (cgroup v1 `cpu`)."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil
import pytest

from diloco.bench import BenchError, hetero, throttle
from diloco.bench.hetero import Launch
from diloco.bench.models import write_model
from tests.support.paths import DILOCO
from tests.support.procs import assert_ok, run_cmd

MATCHMAKING_S = 3.0  # what forming a group costs beyond waiting for the others (hivemind's requests)
MARK = "DILOCO_TEST_MARK"  # every process a test starts inherits it: how the leftovers are found


def marked(mark: str) -> list[psutil.Process]:
    """Running processes whose environment carries `mark` (p2pd included: hivemind passes the environment on)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.pid != psutil.Process().pid and proc.environ().get(MARK) == mark:
                found.append(proc)
    return found


def cgroup_folders(data: dict[str, Any]) -> list[Path]:
    """Every cgroup the bench made (cpu and the cpuacct twin)."""
    folders = [Path(c["cgroup"]) for phase in data["cgroups"].values() for c in phase]
    return folders + [throttle.ACCT_ROOT / f.name for f in folders]


@pytest.mark.slow
def test_hetero_quick(tmp_path: Path) -> None:
    mark, doc = uuid.uuid4().hex, tmp_path / "b.md"
    command = [str(DILOCO), "bench", "hetero", "--quick", "--out", str(tmp_path), "--doc", str(doc)]
    assert_ok(run_cmd(command, timeout=500, env={MARK: mark}))
    data = json.loads((tmp_path / "hetero-quick.json").read_text())
    setup = data["setup"]
    assert data["cores"] == list(hetero.CORES) and len(data["solo"]) == 3
    solo = [s["tokens_per_s"] for s in data["solo"]]
    assert all(s["steps_measured"] >= 1 for s in data["solo"]) and min(solo) > 0
    assert solo[0] > solo[2], solo  # four times the CPU trains faster
    assert data["cgroups"]["solo"][2]["throttled_periods"] > 0  # the kernel held the slowest group back
    assert data["solo_sum_tokens_per_s"] == pytest.approx(sum(solo))
    assert data["fixed_h_expected_ratio"] == pytest.approx(3 * min(solo) / sum(solo))
    expected = list(hetero.ARMS) if hetero.token_arm_available() else ["fixed-H"]
    assert [arm["name"] for arm in data["arms"]] == expected
    for arm in data["arms"]:
        assert arm["wall_s"] > 0 and arm["swarm_tokens_per_s"] > 0 and arm["ratio_to_solo_sum"] > 0, arm
        assert 0 < arm["final_eval_loss"] < math.log(260) and isinstance(arm["same_model"], bool)
        assert arm["swarm_tokens"] == sum(g["tokens"] for g in arm["groups"])
        for g in arm["groups"]:
            assert g["tokens"] == g["inner_steps"] * setup["tokens_per_step"]
            assert sum(g["steps_per_round"]) == g["inner_steps"] and len(g["num_peers"]) == len(g["steps_per_round"])
            assert g["tokens_per_s"] > 0 and g["averaging_s"] >= 0 and len(g["evals"]) == 1  # at the end only
            assert len(g["losses"]) == g["inner_steps"]
            assert g["step_tokens_per_s"] > g["tokens_per_s"]  # it also sat in rounds
        assert len({g["outer_steps"] for g in arm["groups"]}) == 1  # every group ends at the same outer step
    fixed = data["arms"][0]
    for g in fixed["groups"]:
        assert g["inner_steps"] == setup["steps"] and g["steps_per_round"] == [setup["local_steps"]] * 2
    if "target-tokens" in expected:  # under a token budget the faster groups train more steps, weighted by tokens
        token = data["arms"][1]
        fast, slow = token["groups"][0], token["groups"][2]
        assert fast["inner_steps"] > slow["inner_steps"], token
        # every round that formed had all three groups (under the suite's load one can fail: num_peers 0, nothing
        # applied, its tokens carried into the group's next round)
        assert token["same_model"] and all(set(g["num_peers"]) - {0} == {3} for g in token["groups"]), token
        for g in token["groups"]:
            applied = sum(w for w, n in zip(g["weights"], g["num_peers"]) if n)
            assert applied == g["tokens_counted_by_trainer"] == g["tokens"]  # weight = tokens, each round
        # nobody waits for the others longer than the slowest group's inner step, beyond forming the group (unless a
        # round failed: the groups then meet again at the next one, and whoever was in time waits for it)
        slow_step_s = setup["tokens_per_step"] / data["solo"][2]["tokens_per_s"]
        if all(0 not in g["num_peers"] for g in token["groups"]):
            assert all(g["wait_s"] / g["outer_steps"] <= slow_step_s + MATCHMAKING_S for g in token["groups"]), token
    targets = data["targets"]
    if "target-tokens" in expected:
        assert targets["ratio"] == data["arms"][1]["ratio_to_solo_sum"] and isinstance(targets["ratio_met"], bool)
        assert isinstance(targets["eval_gap_met"], bool) and targets["tokens_ratio"] > 0
    assert "## hetero (quick): " in (text := doc.read_text())
    assert "- command: `diloco bench hetero --quick --out " in text and "mixed-shape" in text
    assert "| arm | group | cores | solo tokens/s | swarm tokens/s |" in text
    assert f"| fixed-H | 2 | {hetero.CORES[2]:g} | " in text
    assert data["plot"] == "hetero-quick.png" and (tmp_path / "hetero-quick.png").stat().st_size > 0
    assert not [f for f in cgroup_folders(data) if f.exists()]
    assert not marked(mark), [p.cmdline() for p in marked(mark)]


@pytest.mark.slow
def test_a_failed_phase_leaves_no_cgroup_and_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A swarm trainer (DHT, averager and p2pd running) beside a group that fails once the trainer is ready: one
    BenchError line, and the cgroups, the trainer with its children, and the DHT are all gone."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)  # the bench's children copy this process's environment
    setup = hetero.hetero_setup(quick=True)
    model = write_model(hetero.MODEL, tmp_path / "models")
    ready = tmp_path / "group-0" / "metrics.jsonl"
    wait_then_fail = f"import os, sys, time\nwhile not os.path.exists({str(ready)!r}): time.sleep(0.1)\nsys.exit(3)"
    with ExitStack() as stack:
        peers = hetero.start_dht(stack, tmp_path)
        # a short rendezvous: alone, it gives up waiting for its groupmates after 5 s and creates metrics.jsonl
        flags = [*hetero.arm_flags(setup, "fixed-H", 0, peers), "--hv.averaging-timeout", "5"]
        launches = [
            Launch("test-fail-0", 1.0, hetero.train_command(setup, model, ready.parent, 100, flags), ready.parent),
            Launch("test-fail-1", 0.25, [sys.executable, "-c", wait_then_fail], tmp_path / "group-1"),
        ]
        with pytest.raises(BenchError, match="test-fail-1 exited with code 3") as failed:
            hetero.run_phase(launches, tmp_path, timeout_s=180)
        assert "\n" not in str(failed.value)
    assert not list(throttle.CPU_ROOT.glob(f"diloco-test-fail-*-{psutil.Process().pid}-*"))
    assert not list(throttle.ACCT_ROOT.glob(f"diloco-test-fail-*-{psutil.Process().pid}-*"))
    assert not marked(mark), [p.cmdline() for p in marked(mark)]


# ---------------------------------------------------------------- the report, from a synthetic result


def group(steps: int, rounds: list[int], start: float, end: float, sha: str = "ab", loss: float = 3.0) -> dict:
    """What `group_figures` returns for a group with one step per second from `start`, 100 tokens a step."""
    return {
        "steps": [(start + i, 1.0) for i in range(steps)], "eval_spans": [(start + 1.5, start + 1.75)], "end": end,
        "inner_steps": steps, "tokens": 100 * steps,
        "tokens_counted_by_trainer": 100 * steps, "outer_steps": len(rounds), "steps_per_round": rounds,
        "num_peers": [3] * len(rounds), "weights": None, "wait_s": 1.5, "averaging_s": 2.0,
        "outer_digests": ["d"] * len(rounds), "evals": [(start, 5.5), (end, loss)], "final_eval_loss": loss,
        "losses": [(start + i + 1, 5.0 - i / steps) for i in range(steps)],
        "params_sha256": sha, "summary_steps": steps, "trainer_wall_s": end - start,
    }  # fmt: skip


def cgroups(engaged_at: float) -> list[dict]:
    return [{"cgroup": f"/x/{i}", "engaged_at": engaged_at, "cpu_s": 1.0, "periods": 10, "throttled_periods": 5,
             "throttled_s": 0.5} for i in range(3)]  # fmt: skip


def synthetic(token_steps: int | None, token_loss: float = 3.0) -> dict:
    """A result with a fixed-H arm (10 steps per group in 20 s) and, unless token_steps is None, a token arm whose
    groups trained 18/9/3 × token_steps ÷ 30 steps in 10 s. Solo: 3 / 1.5 / 0.75 steps per second."""
    solo = [{"cores": c, "steps": 10, "steps_measured": 8, "tokens_per_s": 300 * c} for c in (1.0, 0.5, 0.25)]
    arms = [hetero.arm_figures("fixed-H", [group(10, [5, 5], 0.0, 20.0) for _ in range(3)], cgroups(0.0), solo)]
    if token_steps is not None:
        shares = [token_steps * k // 30 for k in (18, 9, 3)]
        groups = [group(n, [n // 2, n - n // 2], 0.0, 10.0, loss=token_loss) for n in shares]
        arms.append(hetero.arm_figures("target-tokens", groups, cgroups(0.0), solo))
    setup = hetero.hetero_setup(quick=True)
    return {
        "bench": "hetero", "quick": True, "date": "2026-11-23 12:00 UTC", "command": "diloco bench hetero --quick",
        "machine": {"cpu": "cpu", "cores": 2, "usable_cores": 2, "ram_gib": 8, "torch": "2", "python": "3",
                    "gpus": [], "load_avg_1m": 1.0},
        "load_avg_1m_end": 1.0, "model": hetero.MODEL, "data": "tinyshakespeare.txt",
        "setup": {**vars(setup), "tokens_per_step": setup.tokens_per_step, "target_tokens": setup.target_tokens},
        "cores": list(hetero.CORES), "solo": solo, "solo_sum_tokens_per_s": 525.0,
        "fixed_h_expected_ratio": 3 * 75 / 525, "arms": arms, "targets": hetero.targets(arms),
        "cgroups": {arm["name"]: cgroups(0.0) for arm in arms} | {"solo": cgroups(0.0)},
        "missing_arms": [] if token_steps is not None else ["target-tokens"],
    }  # fmt: skip


def test_arm_figures_count_only_steps_under_every_quota() -> None:
    """The last quota was set 2.5 s after the first step: steps 0-2 of each group are left out, and so is that
    time; same models in every group or not."""
    solo = [{"tokens_per_s": 100.0}] * 3
    groups = [group(10, [5, 5], 0.0, 12.5) for _ in range(2)] + [group(10, [5, 5], 0.0, 12.5, sha="cd")]
    arm = hetero.arm_figures("fixed-H", groups, cgroups(0.0)[:2] + cgroups(2.5)[2:], solo)
    assert arm["wall_s"] == 12.5 and arm["unthrottled_start_s"] == 2.5
    assert [g["measured_tokens"] for g in arm["groups"]] == [700] * 3
    assert arm["swarm_tokens"] == 3000 and arm["swarm_tokens_per_s"] == pytest.approx(2100 / 10)
    assert arm["ratio_to_solo_sum"] == pytest.approx(2100 / 10 / 300) and arm["same_model"] is False
    assert arm["groups"][0]["evals"] == [(0.0, 5.5), (12.5, 3.0)]
    assert arm["groups"][0]["step_tokens_per_s"] == 100 and arm["groups"][0]["eval_s"] == 0.25


def test_rounds_are_counted_from_the_rows_in_order() -> None:
    inner, outer, evaluation = {"tokens_per_s": 1.0}, {"outer_step": 1}, {"eval_loss": 2.0}
    rows = [evaluation, inner, inner, inner, outer, evaluation, inner, outer, inner]
    assert hetero.rounds_of(rows) == [3, 1]


def test_markdown_reports_targets_met_and_missed() -> None:
    met = hetero.markdown(synthetic(token_steps=60))  # 60 steps in 10 s: 600 tokens/s, 1.14 × the solo sum
    assert "Token budget: 1.14 (target ≥ 0.9: **met**)" in met
    assert "final eval loss +0.00% against fixed H (target ≤ +1%: **met**)" in met
    assert "after 2.00× the fixed arm's tokens" in met
    assert "| fixed-H | 0 | 1 | 300 | 50 | 0.17 | 100 | 10 | 5, 5 | 1.5 | 2.0 | 0.2 | 1.0 | 5/10 |" in met
    assert "(expected about 3 × slowest ÷ sum = 0.43)" in met and "mixed-shape" in met
    missed = hetero.markdown(synthetic(token_steps=30, token_loss=3.1))
    assert "Token budget: 0.57 (target ≥ 0.9: **missed**)" in missed and "+3.33% against fixed H" in missed
    assert "(target ≤ +1%: **missed**)" in missed


def test_markdown_without_the_token_arm_says_so() -> None:
    text = hetero.markdown(synthetic(token_steps=None))
    assert "- not run: target-tokens (this trainer has no `--hv.target-tokens`)" in text
    assert "The token-budget targets were not measured" in text and "| target-tokens |" not in text

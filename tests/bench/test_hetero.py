"""`diloco bench hetero`: three throttled worker groups alone and in swarm arms on an unequal and an equal trio; every
figure in the JSON (discarded steps, full rounds, where the CPU went), the report, the plot, and no cgroup or
process left, also when a phase fails. Needs root (cgroup v1 `cpu`)."""

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

from diloco.bench import BenchError, hetero, hetero_dead, hetero_pause, hetero_report, hetero_solo, throttle
from diloco.bench.hetero import Launch
from diloco.bench.hetero_report import Counters
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
    """Every cgroup the bench made (quotas, helpers, the bootstrap DHT's; cpu and the cpuacct twin)."""
    folders = [Path(c[key]) for phase in data["cgroups"].values() for c in phase for key in ("cgroup", "helpers_cgroup")
               if key in c]  # fmt: skip
    return folders + [throttle.ACCT_ROOT / f.name for f in folders]


def check_quick_arm(arm: dict[str, Any], data: dict[str, Any]) -> None:
    """Every figure of one swarm arm of the quick run exists and is sane."""
    setup, cores = data["setup"], arm["cores"]
    assert cores == data["trios"][arm["trio"]] and arm["name"] in hetero.ARMS
    assert arm["wall_s"] > 0 and arm["swarm_tokens_per_s"] > 0 and arm["ratio_to_solo_sum"] > 0, arm
    assert 0 < arm["final_eval_loss"] < math.log(260) and isinstance(arm["same_model"], bool)
    assert arm["swarm_tokens"] == sum(g["tokens"] for g in arm["groups"])
    assert 0 < arm["swarm_rounds"] and 0 <= arm["full_rounds"] <= arm["swarm_rounds"]
    assert 0 <= arm["full_round_share"] <= 1 and arm["full_round_share"] == arm["full_rounds"] / arm["swarm_rounds"]
    assert isinstance(arm["discarded_steps"], int) and arm["discarded_steps"] >= 0
    assert arm["discarded_steps"] == sum(g["discarded_steps"] for g in arm["groups"])
    window = arm["machine"]["window_s"]
    for i, g in enumerate(arm["groups"]):
        assert g["tokens"] == g["inner_steps"] * setup["tokens_per_step"]
        assert sum(g["steps_per_round"]) == g["inner_steps"] and len(g["num_peers"]) == len(g["steps_per_round"])
        assert g["tokens_per_s"] > 0 and g["averaging_s"] >= 0 and len(g["evals"]) == 1  # at the end only
        assert len(g["losses"]) == g["inner_steps"]
        assert g["step_tokens_per_s"] > g["tokens_per_s"]  # it also sat in rounds
        for key in ("discarded_steps", "discarded_tokens", "carried_steps"):
            assert isinstance(g[key], int) and g[key] >= 0, (key, g[key])
        assert g["discarded_tokens"] == g["discarded_steps"] * setup["tokens_per_step"]
        assert g["rounds"] > 0 and 0 <= g["full_round_share"] <= 1
        t = g["time"]
        assert t["window_s"] == window and t["steps_s"] > 0 and t["rounds_s"] >= 0 and t["after_s"] >= 0
        assert t["steps_s"] + t["rounds_s"] + t["eval_s"] + t["after_s"] <= window + 0.5
        # the quota held the training process over the window; its DHT, p2pd and averager ran beside it, counted
        assert 0 < t["train_cpu_s"] <= cores[i] * window * 1.1 + 0.2, (t, cores[i])
        assert t["helpers_cpu_s"] > 0 and 0 < t["main_share"] <= 1.1
        assert 0 <= t["throttled_share_in_steps"] <= 1 + 1e-9 and t["throttled_s_in_steps"] >= 0
        # speed ÷ solo = cores ÷ solo's over CPU per step ÷ solo's (the same steps' spans)
        assert t["step_speed_vs_solo"] == pytest.approx(t["cores_vs_solo"] / t["cpu_per_step_vs_solo"], rel=1e-6)
    m = arm["machine"]
    assert m["cores"] == data["machine"]["usable_cores"] and m["quota_cores"] == pytest.approx(sum(cores))
    assert m["spare_core_s"] == pytest.approx((m["cores"] - sum(cores)) * window)
    assert m["helpers_core_s"] == pytest.approx(sum(g["time"]["helpers_cpu_s"] for g in arm["groups"]))
    assert m["trainers_core_s"] > 0 and m["dht_core_s"] >= 0 and m["bench_core_s"] > 0
    assert m["trainers_core_s"] + m["helpers_core_s"] <= m["busy_core_s"] * 1.05 + 0.5  # /proc/stat saw them
    assert 0 <= m["idle_core_s"] <= m["capacity_core_s"]


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
    for s, cores in zip(data["solo"], hetero.CORES):
        assert s["cpu_per_step_s"] > 0 and 0 < s["cores_in_steps"] <= cores * 1.25 + 0.05, s
    assert data["solo_sum_tokens_per_s"] == pytest.approx(sum(solo))
    assert data["fixed_h_expected_ratio"] == pytest.approx(3 * min(solo) / sum(solo))
    assert [(arm["trio"], arm["name"]) for arm in data["arms"]] == hetero.arm_list(quick=True)
    for arm in data["arms"]:
        check_quick_arm(arm, data)
    by_name = {hetero_report.arm_key(arm): arm for arm in data["arms"]}
    token = by_name["unequal-tokens"]
    # every round that formed had all three groups (under the suite's load one can fail: num_peers 0, nothing
    # applied, its tokens carried into the group's next round)
    assert token["same_model"] and all(set(g["num_peers"]) - {0} == {3} for g in token["groups"]), token
    for g in token["groups"]:  # under a token budget each group is weighted by its tokens
        applied = sum(w for w, n in zip(g["weights"], g["num_peers"]) if n)
        assert applied == g["tokens_counted_by_trainer"] == g["tokens"]  # weight = tokens, each round
        assert g["moment"] == "group"  # --hv.inner-moment auto: a step is one micro-batch, no halves to split
    fast, slow = token["groups"][0], token["groups"][2]
    assert fast["inner_steps"] > slow["inner_steps"], token
    # nobody waits for the others longer than the slowest group's inner step, beyond forming the group (unless a
    # round failed: the groups then meet again at the next one, and whoever was in time waits for it)
    slow_step_s = setup["tokens_per_step"] / data["solo"][2]["tokens_per_s"]
    if all(0 not in g["num_peers"] for g in token["groups"]):
        assert all(g["wait_s"] / g["outer_steps"] <= slow_step_s + MATCHMAKING_S for g in token["groups"]), token
    targets = data["targets"]
    assert set(targets["arms"]) == set(by_name)
    for name, t in targets["arms"].items():
        assert t["ratio"] == by_name[name]["ratio_to_solo_sum"] and isinstance(t["ratio_met"], bool)
        assert isinstance(t["full_rounds_met"], bool) and isinstance(t["discarded_met"], bool)
    assert targets["eval_gaps"]["unequal"]["fixed"] is None and targets["tokens_default"] is None  # quick: no fixed
    assert "## hetero (quick): " in (text := doc.read_text())
    assert "- command: `diloco bench hetero --quick --out " in text and "mixed-shape" in text
    assert "| trio | arm | group | cores | solo tokens/s | swarm tokens/s |" in text
    assert f"| unequal | tokens | 2 | {hetero.CORES[2]:g} | " in text and "| equal |" not in text
    assert "- unequal tokens (inner AdamW moment group): inner steps at " in text
    assert "helpers (DHT, p2pd, averager) used " in text and "Tokens on unequal groups" not in text
    assert "Decision: not measured" in text
    dead = data["dead"]  # group 2 of the equal trio killed after its first round; the others finish ok
    assert dead["dead_group"] == 2 and dead["killed_after_outer_steps"] == 1 and dead["dead_inner_steps"] > 0
    assert dead["stale_after_kill_s"] > hetero_dead.STALE_S and {r["group"] for r in dead["rounds"]} == {0, 1}
    assert sum(p["rounds"] for p in dead["phases"].values()) == len(dead["rounds"]) > 0
    assert dead["phases"]["before the kill"]["num_peers"] == [3], dead  # all three, until one died
    assert len(data["commands"]["equal-tokens-dead"]) == 3 and "**A dead group** (equal trio, `" in text
    assert data["plot"] == "hetero-quick.png" and (tmp_path / "hetero-quick.png").stat().st_size > 0
    assert not [f for f in cgroup_folders(data) if f.exists()]
    assert not marked(mark), [p.cmdline() for p in marked(mark)]


@pytest.mark.slow
def test_a_failed_phase_leaves_no_cgroup_and_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A swarm trainer (DHT, averager and p2pd running) beside a group that fails once the trainer is ready: one
    BenchError line, and the cgroups (quotas and helpers'), the trainer with its children, and the DHT are all
    gone."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)  # the bench's children copy this process's environment
    setup = hetero.hetero_setup(quick=True)
    model = write_model(hetero.MODEL, tmp_path / "models")
    ready = tmp_path / "group-0" / "metrics.jsonl"
    wait_then_fail = f"import os, sys, time\nwhile not os.path.exists({str(ready)!r}): time.sleep(0.1)\nsys.exit(3)"
    with ExitStack() as stack:
        peers, dht = hetero.start_dht(stack, tmp_path)
        # a short rendezvous: alone, it gives up waiting for its groupmates after 5 s and creates metrics.jsonl
        flags = [*hetero.arm_flags(setup, "unequal", "fixed", 0, peers), "--hv.averaging-timeout", "5"]
        launches = [
            Launch("test-fail-0", 1.0, hetero.train_command(setup, model, ready.parent, 100, flags), ready.parent),
            Launch("test-fail-1", 0.25, [sys.executable, "-c", wait_then_fail], tmp_path / "group-1"),
        ]
        with pytest.raises(BenchError, match="test-fail-1 exited with code 3") as failed:
            hetero.run_phase(launches, tmp_path, timeout_s=180, dht=dht)
        assert "\n" not in str(failed.value)
    assert not dht.folder.exists()
    assert not list(throttle.CPU_ROOT.glob(f"diloco-test-fail-*-{psutil.Process().pid}-*"))
    assert not list(throttle.ACCT_ROOT.glob(f"diloco-test-fail-*-{psutil.Process().pid}-*"))
    assert not marked(mark), [p.cmdline() for p in marked(mark)]


# ---------------------------------------------------------------- figures and report, from synthetic runs


def group(steps: int, rounds: list[int], start: float, end: float, sha: str = "ab", loss: float = 3.0,
          peers: int = 3, discarded: int = 0) -> dict:  # fmt: skip
    """What `group_figures` returns for a group with one step per second from `start`, 100 tokens a step, and a
    round of 0.5 s after each of `rounds` (with `peers` groups)."""
    ends = [start + sum(rounds[: k + 1]) for k in range(len(rounds))]
    return {
        "steps": [(start + i, 1.0) for i in range(steps)], "eval_spans": [(start + 1.5, start + 1.75)], "end": end,
        "round_spans": [(e - 0.5, e) for e in ends], "inner_steps": steps, "tokens": 100 * steps,
        "tokens_counted_by_trainer": 100 * steps, "outer_steps": len(rounds), "steps_per_round": rounds,
        "num_peers": [peers] * len(rounds), "outer_step_of_rows": list(range(1, len(rounds) + 1)),
        "rounds": len(rounds), "weights": None, "wait_s": 1.5, "averaging_s": 2.0, "discarded_steps": discarded,
        "discarded_tokens": 100 * discarded, "carried_steps": 0, "loads": 0, "outer_digests": ["d"] * len(rounds),
        "evals": [(start, 5.5), (end, loss)], "final_eval_loss": loss,
        "losses": [(start + i + 1, 5.0 - i / steps) for i in range(steps)],
        "params_sha256": sha, "summary_steps": steps, "trainer_wall_s": end - start,
    }  # fmt: skip


def cgroups(engaged_at: float) -> list[dict]:
    return [{"cgroup": f"/x/{i}", "helpers_cgroup": f"/x/{i}-h", "engaged_at": engaged_at, "cpu_s": 1.0,
             "periods": 10, "throttled_periods": 5, "throttled_s": 0.5, "helpers_cpu_s": 0.1}
            for i in range(3)]  # fmt: skip


def counters(cores: list[float], until: float = 40.0, helpers: float = 0.05, busy: float = 1.9) -> Counters:
    """Sampler series every 0.1 s from 0 to `until`: group i's trainer at `cores[i]` (its main thread at 90% of it),
    its helpers at `helpers` core, the bootstrap DHT at 0.01, the bench at 0.02, the machine at `busy` cores."""
    times = [k / 10 for k in range(int(until * 10) + 1)]
    series: dict[str, Any] = {"t": times, "busy": [busy * t for t in times], "steal": [0.0 for _ in times],
                              "bench": [0.02 * t for t in times], "dht": [0.01 * t for t in times]}  # fmt: skip
    series |= {
        "train": [[c * t for t in times] for c in cores], "main": [[0.9 * c * t for t in times] for c in cores],
        "helpers": [[helpers * t for t in times] for _ in cores],
        "throttled_s": [[0.1 * t for t in times] for _ in cores], "throttled": [[5 * t for t in times] for _ in cores],
        "periods": [[10 * t for t in times] for _ in cores],
    }  # fmt: skip
    return Counters(series)


SOLO = [{"cores": c, "steps": 10, "steps_measured": 8, "tokens_per_s": 300 * c, "cpu_per_step_s": c / 3,
         "cores_in_steps": c, "main_share": 0.95} for c in (1.0, 0.5, 0.25)]  # fmt: skip


def synthetic(token_steps: int | None, token_loss: float = 3.0, equal_token_loss: float = 3.0) -> dict:
    """A result with every arm on both trios: the fixed arms (10 steps per group in 20 s) and, unless token_steps is
    None, the tokens arms, whose groups trained 18/9/3 × token_steps ÷ 30 steps in 10 s. Solo: 3 / 1.5 / 0.75 steps
    per second."""
    arms = []
    for trio, alone in (("unequal", SOLO), ("equal", [SOLO[1]] * 3)):
        for name in ("old-fixed", "fixed"):
            groups = [group(10, [5, 5], 0.0, 20.0) for _ in range(3)]
            arms.append(hetero_report.arm_figures(name, groups, cgroups(0.0), alone, counters([0.5] * 3), trio))
        if token_steps is not None:
            shares = [token_steps * k // 30 for k in (18, 9, 3)]
            loss = token_loss if trio == "unequal" else equal_token_loss
            groups = [group(n, [n // 2, n - n // 2], 0.0, 10.0, loss=loss) for n in shares]
            arms.append(hetero_report.arm_figures("tokens", groups, cgroups(0.0), alone, counters([0.5] * 3), trio))
    setup = hetero.hetero_setup(quick=True)
    return {
        "bench": "hetero", "quick": True, "date": "2026-11-23 12:00 UTC", "command": "diloco bench hetero --quick",
        "machine": {"cpu": "cpu", "cores": 2, "usable_cores": 2, "ram_gib": 8, "torch": "2", "python": "3",
                    "gpus": [], "load_avg_1m": 1.0},
        "load_avg_1m_end": 1.0, "model": hetero.MODEL, "data": "tinyshakespeare.txt",
        "setup": {**vars(setup), "tokens_per_step": setup.tokens_per_step, "target_tokens": setup.target_tokens},
        "cores": [1.0, 0.5, 0.25], "trios": {"unequal": [1.0, 0.5, 0.25], "equal": [0.5] * 3},
        "arm_flags": hetero.ARM_FLAGS, "solo": SOLO, "solo_sum_tokens_per_s": 525.0,
        "fixed_h_expected_ratio": 3 * 75 / 525, "arms": arms, "targets": hetero_report.targets(arms),
        "cgroups": {hetero_report.arm_key(arm): cgroups(0.0) for arm in arms} | {"solo": cgroups(0.0)},
    }  # fmt: skip


def test_arm_figures_count_only_steps_under_every_quota() -> None:
    """The last quota was set 2.5 s after the first step: steps 0-2 of each group are left out, and so is that
    time; same models in every group or not; rounds with every group, and discarded steps, counted."""
    solo = [{"tokens_per_s": 100.0, "cores": 0.5}] * 3
    groups = [group(10, [5, 5], 0.0, 12.5) for _ in range(2)] + [group(10, [5, 5], 0.0, 12.5, sha="cd")]
    groups[2]["num_peers"], groups[2]["discarded_steps"] = [2, None], 3  # a round without it, then a load
    groups[0]["num_peers"] = groups[1]["num_peers"] = [2, 3]
    arm = hetero_report.arm_figures("fixed", groups, cgroups(0.0)[:2] + cgroups(2.5)[2:], solo)
    assert arm["wall_s"] == 12.5 and arm["unthrottled_start_s"] == 2.5
    assert [g["measured_tokens"] for g in arm["groups"]] == [700] * 3
    assert arm["swarm_tokens"] == 3000 and arm["swarm_tokens_per_s"] == pytest.approx(2100 / 10)
    assert arm["ratio_to_solo_sum"] == pytest.approx(2100 / 10 / 300) and arm["same_model"] is False
    assert arm["groups"][0]["evals"] == [(0.0, 5.5), (12.5, 3.0)]
    assert arm["groups"][0]["step_tokens_per_s"] == 100 and arm["groups"][0]["eval_s"] == 0.25
    # outer step 1: at most 2 groups; outer step 2: all 3 in group 1's row
    assert (arm["full_rounds"], arm["swarm_rounds"], arm["full_round_share"]) == (1, 2, 0.5)
    assert [g["full_round_share"] for g in arm["groups"]] == [0.5, 0.5, 0.0] and arm["discarded_steps"] == 3
    assert arm["machine"] is None and arm["groups"][0]["time"]["train_cpu_s"] is None


def test_where_the_time_went_from_the_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU integrated over the steps and the window: a trainer that took 1 CPU-second per step alone at 1 core
    runs at 0.5 core in the swarm, 2 s a step: half its solo speed, all of it from fewer cores per second, none
    from more CPU per step; the machine's CPU beside the quotas counted."""
    monkeypatch.setattr(hetero_report, "usable_cores", lambda: 2)
    solo = [{"tokens_per_s": 100.0, "cores": 1.0, "cpu_per_step_s": 1.0, "cores_in_steps": 1.0}] * 3
    groups = [group(10, [5, 5], 0.0, 20.0) for _ in range(3)]
    for g in groups:  # two seconds a step: 50 tokens/s
        g["steps"] = [(2.0 * i, 2.0) for i in range(10)]
        g["round_spans"] = [(19.0, 20.0)]
    arm = hetero_report.arm_figures("tokens", groups, cgroups(0.0), solo, counters([0.5] * 3, helpers=0.1))
    t = arm["groups"][0]["time"]
    assert t["window_s"] == 20.0 and t["steps_s"] == 20.0 and t["rounds_s"] == 1.0 and t["after_s"] == 0.0
    assert t["cpu_per_step_s"] == pytest.approx(1.0) and t["cores_in_steps"] == pytest.approx(0.5)
    assert t["main_share"] == pytest.approx(0.9) and t["throttled_share_in_steps"] == pytest.approx(0.5)
    assert t["train_cpu_s"] == pytest.approx(10.0) and t["helpers_cpu_s"] == pytest.approx(2.0)
    assert t["step_speed_vs_solo"] == 0.5 and t["cpu_per_step_vs_solo"] == pytest.approx(1.0)
    assert t["cores_vs_solo"] == pytest.approx(0.5) == t["step_speed_vs_solo"] / t["cpu_per_step_vs_solo"]
    m = arm["machine"]
    assert m["spare_core_s"] == pytest.approx((2 - 3.0) * 20) and m["busy_core_s"] == pytest.approx(38.0)
    assert m["trainers_core_s"] == pytest.approx(30.0) and m["helpers_core_s"] == pytest.approx(6.0)
    assert m["dht_core_s"] == pytest.approx(0.2) and m["bench_core_s"] == pytest.approx(0.4)
    assert m["others_core_s"] == pytest.approx(38.0 - 30.0 - 6.0 - 0.2 - 0.4) and m["idle_core_s"] == pytest.approx(2)
    line = hetero_report.explain_arm(arm, solo)
    assert "inner steps at 0.50 / 0.50 / 0.50 of solo speed" in line and "1.00 / 1.00 / 1.00× its solo CPU" in line
    assert "0% of the gap is more CPU per step, 100% fewer cores per second" in line
    assert "helpers (DHT, p2pd, averager) used 6.0 core-s" in line and "spare capacity of -20.0" in line


def test_the_galaxy_moment_cost_is_the_cpu_per_step_of_tokens_galaxy_against_tokens() -> None:
    """Same steps, the training process at 0.5 core in tokens-galaxy and at 0.25 in tokens: twice the CPU a step."""
    solo = [{"tokens_per_s": 100.0, "cores": 1.0, "cpu_per_step_s": 1.0, "cores_in_steps": 1.0}] * 3
    arms = []
    for name, cores, moment in (("tokens", 0.25, "group"), ("tokens-galaxy", 0.5, "galaxy")):
        groups = [group(10, [5, 5], 0.0, 20.0) | {"moment": moment} for _ in range(3)]
        arms.append(hetero_report.arm_figures(name, groups, cgroups(0.0), solo, counters([cores] * 3)))
    result = {"arms": arms, "solo": solo}
    lines = hetero_report.explain(result)
    assert len(lines) == 3 and lines[0].startswith("unequal tokens (inner AdamW moment group): inner steps at")
    assert lines[1].startswith("unequal tokens-galaxy (inner AdamW moment galaxy): ")
    assert "of the gap" not in lines[0] + lines[1]  # steps at solo speed: cores and CPU per step both halved
    assert lines[2] == ("unequal: an inner step of tokens-galaxy (inner AdamW moment galaxy / group in "
                        "tokens-galaxy / tokens) took 2.00 / 2.00 / 2.00× the CPU of the same step in tokens "
                        "(`--hv.inner-moment auto`): what the galaxy moment's two halves of a lone micro-batch cost "
                        "per step, measured.")  # fmt: skip


def test_rounds_are_counted_from_the_rows_in_order() -> None:
    inner, outer, evaluation = {"tokens_per_s": 1.0}, {"outer_step": 1}, {"eval_loss": 2.0}
    rows = [evaluation, inner, inner, inner, outer, evaluation, inner, outer, inner]
    assert hetero.rounds_of(rows) == [3, 1]


def test_arms_and_their_flags() -> None:
    """old-fixed is the former defaults, fixed and tokens only the pace; every arm pins H and the outer SGD."""
    setup = hetero.hetero_setup(quick=False)
    assert hetero.arm_list(quick=False) == [("unequal", "old-fixed"), ("unequal", "fixed"), ("unequal", "tokens"),
                                            ("unequal", "tokens-galaxy"), ("equal", "old-fixed"), ("equal", "fixed"),
                                            ("equal", "tokens")]  # fmt: skip
    flags = {arm: hetero.arm_flags(setup, "equal", arm, 1, ["/p"]) for arm in hetero.ARMS}
    assert "--hv.late-work drop" in " ".join(flags["old-fixed"]) and "--hv.matchmaking-time 5" in " ".join(
        flags["old-fixed"]
    )
    for arm, f in flags.items():
        line = " ".join(f)
        assert f"--hv.local-steps {setup.local_steps}" in line and "--hv.outer-lr 1.0 --hv.outer-momentum 0" in line
        assert "--hv.target-tokens" not in line and "--hv.averaging-timeout" not in line
        assert ("--hv.matchmaking-time" in line) == (arm == "old-fixed") and f"hetero-equal-{arm}" in line
    assert "--hv.pace tokens" in " ".join(flags["tokens"]) and "--hv.pace fixed" in " ".join(flags["fixed"])
    assert " ".join(flags["tokens-galaxy"]).count("--hv.inner-moment galaxy") == 1
    assert not any("--hv.inner-moment" in " ".join(flags[arm]) for arm in ("old-fixed", "fixed", "tokens"))
    assert hetero.TRIOS["equal"] == (hetero.CORES[1],) * 3 and sum(hetero.CORES) < 2


def test_markdown_reports_targets_met_and_missed() -> None:
    met = hetero_report.markdown(synthetic(token_steps=60))  # 60 steps in 10 s: 600 tokens/s, 1.14 × solo's sum
    assert "unequal tokens: swarm ÷ Σ solo 1.14 (≥ 0.95: **met**), full rounds 100% (≥ 95%: **met**), " \
           "discarded steps 0 (= 0: **met**), final eval loss 3.0000." in met  # fmt: skip
    assert "unequal fixed: swarm ÷ Σ solo 0.29 (≥ 0.95: **missed**)" in met
    assert "Tokens on equal groups: final eval loss +0.00% against fixed (≤ +1%: **met**), +0.00% " \
           "against old-fixed." in met  # fmt: skip
    assert "Tokens on unequal groups: final eval loss +0.00% against fixed (< 0: **missed**)" in met
    assert "Decision: `--hv.pace tokens` as the default: **no**" in met
    # discarded, carried, full rounds, idle, rounds, evals, CPU under quota, helpers' CPU, throttled periods
    assert "| unequal | fixed | 0 | 1 | 300 | 50 | 0.17 | 100 | 10 | 5, 5 | 0 | 0 | 100% | 1.5 | 2.0 | 0.2 | 1.0 | " \
           "1.0 | 5/10 |" in met  # fmt: skip
    assert "3 × slowest ÷ sum = 0.43 of it" in met and "mixed-shape" in met
    assert "- unequal tokens (inner AdamW moment unknown): inner steps at " in met  # no log
    assert "- equal tokens (inner AdamW moment unknown): inner steps at " in met
    better = hetero_report.markdown(synthetic(token_steps=30, token_loss=2.9, equal_token_loss=3.02))
    assert "Tokens on unequal groups: final eval loss -3.33% against fixed (< 0: **met**)" in better
    assert "Tokens on equal groups: final eval loss +0.67% against fixed (≤ +1%: **met**)" in better
    assert "Decision: `--hv.pace tokens` as the default: **yes**" in better
    worse = hetero_report.markdown(synthetic(token_steps=30, token_loss=2.9, equal_token_loss=3.1))
    assert "(≤ +1%: **missed**)" in worse and "as the default: **no**" in worse


def test_markdown_without_the_tokens_arms_says_so() -> None:
    result = synthetic(token_steps=None)
    text = hetero_report.markdown(result)
    assert result["targets"]["tokens_default"] is None and "Decision: not measured" in text
    assert "| tokens |" not in text and "Tokens on" not in text


def outer_row(time: float, wait_s: float, peers: int, averaging_s: float = 1.0) -> dict:
    return {"time": time, "outer_step": 1, "wait_s": wait_s, "averaging_s": averaging_s, "num_peers": peers}


def test_a_dead_groups_rounds_are_sorted_by_when_they_began_against_its_kill_and_staleness() -> None:
    """Killed at t = 100 after steps of 1 s (100 tokens at 100 tokens/s): stale 17 s later. Rounds that began before
    100, in [100, 117) and after fall in the three phases; waits within the floor while fresh and no longer than
    before once stale meet the claim, a longer one after does not."""
    dead_rows = [{"time": 90.0 + i, "tokens_per_s": 100.0} for i in range(8)]
    survivors = [[outer_row(80, 1.0, 3), outer_row(106, 5.0, 2), outer_row(130, 0.5, 2)],
                 [outer_row(81, 0.8, 3), {"time": 107.0, "outer_step": 2, "loaded_state_from": 0},
                  outer_row(131, 0.4, 2)]]  # fmt: skip
    dead = hetero_dead.dead_figures(survivors, dead_rows, killed_at=100.0, tokens_per_step=100, after=2)
    assert dead["stale_after_kill_s"] == pytest.approx(hetero_dead.STALE_S + 2.0)
    assert dead["killed_after_outer_steps"] == 2 and dead["dead_inner_steps"] == 8
    phases = dead["phases"]
    assert [phases[p]["rounds"] for p in hetero_dead.PHASES] == [2, 1, 2]  # the load without a round: none
    assert phases["record still fresh"] == {"rounds": 1, "mean_wait_s": 5.0, "max_wait_s": 5.0, "num_peers": [2]}
    assert dead["fresh_within_bound"] and dead["stale_costs_nothing"]
    assert [r["since_kill_s"] for r in dead["rounds"]] == [-21.0, -20.0, 5.0, 29.0, 30.0]
    survivors[0][2] = outer_row(130, 6.0, 2)
    later = hetero_dead.dead_figures(survivors, dead_rows, killed_at=100.0, tokens_per_step=100, after=2)
    assert not later["stale_costs_nothing"]
    text = "\n".join(hetero_dead.dead_lines(later, "--hv.pace tokens"))
    assert "| record stale | 2 | 2 | 3.2 | 6.0 |" in text and "then nothing" not in text and "**missed**" in text


def test_a_paused_groups_evaluations_are_matched_with_the_next_round_the_others_began() -> None:
    """Evaluations at steps 0 (before any round), 20, 40 and at the end (step 60): only those of 20 and 40 count.
    Each is matched with the first round of the other groups that began after it started (a round's start: its row's
    time less its averaging_s); all groups in both rounds meet the claim, a round one of the others took without
    the paused group does not."""
    paused = [{"step": 0, "eval_loss": 5.0, "time": 10.0}, {"step": 20, "eval_loss": 4.0, "time": 108.0},
              {"step": 40, "eval_loss": 3.0, "time": 208.0}, {"step": 60, "eval_loss": 2.0, "time": 300.0}]
    eval_s = [8.0, 8.0, 7.0, 9.0]
    assert hetero_pause.evaluations(paused, eval_s) == [(100.0, 8.0), (201.0, 7.0)]
    others = [[outer_row(99, 0.2, 3), outer_row(118, 8.5, 3, averaging_s=9.0), outer_row(218, 7.2, 3, 8.0)],
              [outer_row(99.5, 0.1, 3), outer_row(118.2, 8.6, 3, 9.1), outer_row(218.1, 7.0, 3, 8.1)]]
    pause = hetero_pause.pause_figures(others, paused, eval_s, groups=3)
    assert [(p["evaluation"], p["num_peers"], p["wait_s"]) for p in pause["pauses"]] == [(1, 3, 8.6), (2, 3, 7.2)]
    assert pause["pauses"][0]["round_began_s"] == pytest.approx(9.0)  # 109 − 100
    assert pause["waited_for"] and pause["past_floor"] == 2
    others[1][2] = outer_row(218.1, 5.0, 2, 8.1)  # the second: one of the others went without the paused group
    late = hetero_pause.pause_figures(others, paused, eval_s, groups=3)
    assert not late["waited_for"] and [p["num_peers"] for p in late["pauses"]] == [3, 2]  # a split is a miss
    text = "\n".join(hetero_pause.pause_lines(late, "--hv.pace fixed"))
    assert "| 2 | 7.0 | 9.0 | 2 | 7.2 |" in text and "**missed**" in text and "2 of 2 waited past" in text


def test_the_solo_runs_side_by_side_split_what_the_machine_costs_from_what_the_swarm_costs() -> None:
    """Three solo runs at once at 0.8 of their speed alone (1.25× the CPU per step): the arm's tokens/s is given
    against both sums, and a line says what sharing the machine cost before any swarm."""
    alone = [{"tokens_per_s": 100.0, "cores": 0.5, "cpu_per_step_s": 1.0, "cores_in_steps": 0.5}] * 3
    side = [s | {"tokens_per_s": 80.0, "cpu_per_step_s": 1.25} for s in alone]
    groups = [group(10, [5, 5], 0.0, 20.0) for _ in range(3)]  # 50 tokens/s each
    arm = hetero_report.arm_figures("tokens", groups, cgroups(0.0), alone, None, "equal", side)
    assert arm["ratio_to_solo_sum"] == pytest.approx(150 / 300)
    assert arm["ratio_to_side_by_side_sum"] == pytest.approx(150 / 240)
    assert hetero_report.arm_figures("tokens", [group(10, [5, 5], 0.0, 20.0) for _ in range(3)], cgroups(0.0),
                                     alone)["ratio_to_side_by_side_sum"] is None  # fmt: skip
    result = {"arms": [arm], "solo": alone, "side_by_side": {"equal": side}, "quick": False}
    line = hetero_report.side_by_side_line(result, "equal")
    assert line == ("equal trio side by side (its three solo runs at once, no swarm): 240 tokens/s, 0.80 of the sum "
                    "alone; each at 0.80 / 0.80 / 0.80 of its solo speed, 1.25 / 1.25 / 1.25× its CPU per step: what "
                    "sharing this machine costs before any swarm. Against this sum the arms reach tokens 0.62.")
    assert line in hetero_report.explain(result)
    assert hetero_report.side_by_side_line(result, "unequal") is None
    assert "; 0.62 of Σ solo side by side" in hetero_report.side_note(arm)


def test_solo_runs_before_and_after_the_arms_bracket_them_and_the_drift_is_said() -> None:
    """The host ran the solo runs after the arms 1.25× as fast as before: each group's reference is the mean of both
    (its CPU per step too), the drift is given per group, and each arm's ratio against either run beside the mean."""
    before = [{"tokens_per_s": 100.0 * c, "cores": c, "cpu_per_step_s": 1.0, "cores_in_steps": c, "main_share": 0.99,
               "throttled_share_in_steps": 1.0, "steps": 30} for c in (1.0, 0.5, 0.25)]  # fmt: skip
    after = [s | {"tokens_per_s": 125.0 * s["cores"], "cpu_per_step_s": 0.8} for s in before]
    solo = hetero_solo.bracket(before, after)
    assert [s["tokens_per_s"] for s in solo] == [112.5, 56.25, 28.125]
    assert [s["drift"] for s in solo] == [1.25] * 3 and solo[0]["cpu_per_step_s"] == pytest.approx(0.9)
    assert solo[0]["tokens_per_s_before"] == 100.0 and solo[0]["tokens_per_s_after"] == 125.0
    assert solo[0]["steps"] == 30 and before[0]["tokens_per_s"] == 100.0  # (the runs' own figures unchanged)
    assert hetero_solo.bracket(before, None) is before  # the quick run: solo once
    with pytest.raises(ValueError, match="bracket no group"):
        hetero_solo.bracket(before, after[::-1])
    groups = [group(10, [5, 5], 0.0, 20.0) for _ in range(3)]  # 50 tokens/s each: 150
    arm = hetero_report.arm_figures("tokens", groups, cgroups(0.0), solo, None, "unequal")
    assert arm["ratio_to_solo_sum"] == pytest.approx(150 / 196.875)
    assert arm["ratio_to_solo_runs"] == pytest.approx({"before": 150 / 175, "after": 150 / 218.75})
    assert "; 0.86 / 0.69 of Σ solo before / after the arms" in hetero_report.side_note(arm)
    line = hetero_solo.drift_line(solo)
    assert line is not None and "(1 / 0.5 / 0.25 core): 1.25 / 1.25 / 1.25" in line
    assert line in hetero_report.explain({"arms": [], "solo": solo, "quick": False})
    assert hetero_solo.drift_line(before) is None and hetero_solo.ratios_either_side(before, 150.0) is None

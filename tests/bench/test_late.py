"""`diloco bench convergence --study late`: groups late to rounds keep (`--hv.late-work keep`) or drop their inner
steps through the product's own outer loop, on a tiny model in seconds; the figures and the section from them."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco.bench import BenchError
from diloco.bench import late as late_study
from diloco.bench.convergence import Workload, auto_arm, load_corpus, run_arm
from diloco.bench.late import LateArm, late_specs, run_late_arm, summarize
from diloco.bench.models import model_folder
from tests.support.bench import bench
from tests.support.paths import CORPUS

H, STEPS = 2, 8  # 4 rounds: late at rounds 1 and 3 (odd), or 1 to 3 (every)
LATE = {2: (1,), 4: (2, 3)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Workload, Any]:
    w = Workload("llama-0.1m-bytes", 16, 2, STEPS, 3e-3, 1, 1, 2)
    w = replace(w, model=model_folder(w.model, tmp_path_factory.mktemp("models")))
    return w, load_corpus(w, CORPUS)


def arms(k: int) -> list[LateArm]:
    return [LateArm("ontime", k, H, 0)] + [
        LateArm(f"late-{policy}-{pattern}", k, H, 0, policy, pattern, LATE[k])
        for pattern in ("odd", "every") for policy in ("keep", "drop")
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tiny: tuple[Workload, Any]) -> dict[tuple[int, str], dict[str, Any]]:
    torch.set_num_threads(1)
    return {(arm.k, arm.name): run_late_arm(arm, *tiny) for k in (2, 4) for arm in arms(k)}


def late_groups(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [g for g in run["groups"] if g["late"]]


@pytest.mark.parametrize("k", [2, 4])
def test_every_arm_ends_on_one_outer_state_and_one_model(runs: dict, k: int) -> None:
    for (arm_k, name), run in runs.items():
        if arm_k != k:
            continue
        assert run["one_state"] and run["groups_identical"], name
        assert len({g["outer_digest"] for g in run["groups"]}) == 1, name
        assert all(g["outer_steps"] == STEPS // H for g in run["groups"]), name  # every round, late ones loaded
        for g in run["groups"]:
            if not g["late"]:  # the on-time groups train every step and lose none
                assert (g["trained_steps"], g["discarded_steps"], g["carried_rows"], g["loads"]) == (STEPS, 0, 0, 0)


@pytest.mark.parametrize("k", [2, 4])
def test_ontime_has_no_late_group_nothing_discarded_nothing_carried(runs: dict, k: int) -> None:
    run = runs[k, "ontime"]
    assert not late_groups(run) and run["late_at"] == []
    for g in run["groups"]:
        assert g["late_rounds"] == [] and g["loads"] == 0
        assert g["discarded_steps"] == 0 and g["carried_steps"] == 0 and g["carried_rows"] == 0
    assert run["swarm_tokens_trained"] == run["swarm_tokens_landed"] == k * STEPS * 2 * 16


@pytest.mark.parametrize("k", [2, 4])
def test_kept_late_work_is_carried_into_the_next_round_and_never_discarded(runs: dict, k: int) -> None:
    for pattern in ("odd", "every"):
        run = runs[k, f"late-keep-{pattern}"]
        assert [g["world_rank"] for g in late_groups(run)] == list(LATE[k])
        for g in late_groups(run):
            # late at rounds 1 and 3 under either pattern: the jump to the next boundary puts it on time there
            assert g["late_rounds"] == [1, 3] and g["loads"] == 2
            assert g["discarded_steps"] == 0 and g["carried_rows"] == 2 and g["carried_steps"] == 2 * H
            # it skipped the round it jumped over: it trained only what it carried, all of it landing
            assert g["trained_steps"] == 2 * H
            # landed in rounds 2 and 4 with every group there, one round of tokens each
            assert g["carried_rounds"] == [(2, k, 1.0), (4, k, 1.0)]
        assert run["swarm_tokens_trained"] == run["swarm_tokens_landed"]
    # a group always late comes late only every other round under keep: the same run as odd
    assert runs[k, "late-keep-every"]["final_eval_loss"] == runs[k, "late-keep-odd"]["final_eval_loss"]


@pytest.mark.parametrize("k", [2, 4])
def test_dropped_late_work_is_discarded_and_counted(runs: dict, k: int) -> None:
    for pattern, rounds in (("odd", [1, 3]), ("every", [1, 2, 3])):
        run = runs[k, f"late-drop-{pattern}"]
        for g in late_groups(run):
            assert g["late_rounds"] == rounds and g["loads"] == len(rounds)
            assert g["discarded_steps"] == H * len(rounds) > 0 and g["carried_rows"] == 0 and g["carried_steps"] == 0
            assert g["trained_steps"] == STEPS  # it trains every step; the late rounds' are thrown away
        discarded = sum(g["discarded_tokens"] for g in run["groups"])
        assert run["swarm_tokens_trained"] == runs[k, "ontime"]["swarm_tokens_trained"]
        assert run["swarm_tokens_landed"] == run["swarm_tokens_trained"] - discarded
    # late at the same rounds, keep and drop land as many tokens: keep trains fewer
    keep, drop = runs[k, "late-keep-odd"], runs[k, "late-drop-odd"]
    assert keep["swarm_tokens_landed"] == drop["swarm_tokens_landed"] < drop["swarm_tokens_trained"]
    assert keep["final_eval_loss"] != drop["final_eval_loss"]  # what landed differs: stale steps, fresh ones


def test_an_arm_is_deterministic(runs: dict, tiny: tuple[Workload, Any]) -> None:
    """The on-time groups wait at a late round until the late group downloaded their state, so the inner step it
    takes over never depends on the threads' timing; ontime trains exactly as the convergence arm of its setting."""
    again = run_late_arm(LateArm("late-drop-every", 2, H, 0, "drop", "every", (1,)), *tiny)
    assert again["final_eval_loss"] == runs[2, "late-drop-every"]["final_eval_loss"]
    w, corpus = tiny
    auto = run_arm(auto_arm(2, w, H, 0), w, corpus)
    assert auto["final_eval_loss"] == runs[2, "ontime"]["final_eval_loss"]


def test_a_slow_download_changes_nothing(runs: dict, tiny: tuple[Workload, Any],
                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The late group's download takes a while (a real one crosses the network): the on-time groups wait for it at
    the boundary, so the state it loads holds their step count there, not a later one (a dropping group that took a
    later count would train fewer inner steps)."""
    real = late_study.LateMember.download_state

    def slow(self: late_study.LateMember, record: Any, rank: int, wanted: Any = None) -> Any:
        time.sleep(0.3)
        return real(self, record, rank, wanted)

    monkeypatch.setattr(late_study.LateMember, "download_state", slow)
    again = run_late_arm(LateArm("late-drop-every", 2, H, 0, "drop", "every", (1,)), *tiny)
    assert again["groups"] == runs[2, "late-drop-every"]["groups"]
    assert again["final_eval_loss"] == runs[2, "late-drop-every"]["final_eval_loss"]


def test_a_failing_group_stops_the_arm_instead_of_hanging(tiny: tuple[Workload, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    real = late_study.inner_step

    def failing(*args: Any) -> Any:
        if threading.current_thread().name.endswith("-g0"):
            raise RuntimeError("group 0 broke")
        return real(*args)

    monkeypatch.setattr(late_study, "inner_step", failing)
    with pytest.raises(BenchError, match="group 0 broke"):
        run_late_arm(LateArm("late-keep-odd", 2, H, 0, "keep", "odd", (1,)), *tiny)


def test_the_figures_compare_keep_with_drop_and_both_with_ontime(runs: dict) -> None:
    specs = [a for k in (2, 4) for a in arms(k)]
    result = summarize([run | {"seed": 0} for run in runs.values()], specs)
    by = {(a["k"], a["name"]): a for a in result["arms"]}
    assert [(a["k"], a["name"]) for a in result["arms"]] == [(a.k, a.name) for a in specs]
    for c in result["keep_vs_drop"]:
        keep, drop = runs[c["k"], f"late-keep-{c['pattern']}"], runs[c["k"], f"late-drop-{c['pattern']}"]
        ontime = runs[c["k"], "ontime"]["final_eval_loss"]
        assert c["keep_minus_drop"] == pytest.approx(keep["final_eval_loss"] - drop["final_eval_loss"])
        assert c["keep_vs_drop"] == pytest.approx(keep["final_eval_loss"] / drop["final_eval_loss"] - 1)
        assert c["keep_vs_ontime"] == pytest.approx(keep["final_eval_loss"] / ontime - 1)
        assert c["drop_vs_ontime"] == by[c["k"], f"late-drop-{c['pattern']}"]["vs_ontime"]
    assert [(c["k"], c["pattern"]) for c in result["keep_vs_drop"]] == [(2, "odd"), (2, "every"), (4, "odd"),
                                                                       (4, "every")]  # fmt: skip
    info = {"cpu": "cpu", "cores": 2, "usable_cores": 2, "ram_gib": 1, "torch": "t", "python": "p", "gpus": [],
            "load_avg_1m": 0.0}  # fmt: skip
    doc = late_study.markdown(result | {"bench": "convergence", "quick": True, "date": "d", "machine": info,
                                        "load_avg_1m_end": 0.0, "command": "c", "h": H, "workers": 1,
                                        "workload": {"model": "m", "corpus": "c", "parameters": 1e5,
                                                     "seq_length": 16, "batch": 2, "steps": STEPS, "lr": 3e-3,
                                                     "warmup_steps": 1, "eval_batches": 1, "seeds": [0]}})  # fmt: skip
    assert "| 2 | late-keep-odd | " in doc and "| 4 | late-drop-every | " in doc and "| 4 | every | " in doc
    assert "0 / 4 (2 rows)" in doc  # a late group under keep: nothing discarded, its steps carried in 2 rows


def test_the_specs_are_the_study() -> None:
    w = Workload("m", 128, 8, 200, 3e-3, 20, 16, 4, seeds=(0, 1))
    specs = late_specs(w, quick=False)
    assert len(specs) == 2 * 2 * 5 and {s.h for s in specs} == {25}
    assert {s.late_groups for s in specs if s.k == 2 and s.pattern} == {(1,)}
    assert {s.late_groups for s in specs if s.k == 4 and s.pattern} == {(2, 3)}
    odd = next(s for s in specs if s.pattern == "odd")
    every = next(s for s in specs if s.pattern == "every")
    assert odd.late_rounds(200) == {1, 3, 5, 7} and every.late_rounds(200) == set(range(1, 8))  # never the last


@pytest.mark.slow
def test_convergence_late_quick(tmp_path: Path) -> None:
    data, doc = bench("convergence", tmp_path, "--data", str(CORPUS), "--study", "late", stem="convergence-late")
    assert data["study"] == "late" and {a["name"] for a in data["arms"]} == {
        "ontime", "late-keep-odd", "late-drop-odd", "late-keep-every", "late-drop-every"}  # fmt: skip
    assert all(a["one_state"] and a["groups_identical"] for a in data["arms"])
    assert "Keep against drop" in doc and "--study late" in data["command"]
    assert (tmp_path / "convergence-late-quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

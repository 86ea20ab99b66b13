"""`diloco bench`: the quick benches run real trainers and write a JSON result and a markdown table (to tmp)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from diloco import bench as benches
from diloco.outer.auto import auto_outer
from tests.support.bench import bench
from tests.support.paths import CORPUS, DILOCO, ROOT
from tests.support.procs import run_cmd


def assert_measured(arm: dict) -> None:
    for key in ("tokens_per_s", "peak_memory_mb", "tree_peak_rss_mb"):
        assert arm[key] > 0, (arm["name"], key)


def assert_table(doc: str, title: str, arms: list[str]) -> None:
    assert f"## {title} (quick): " in doc
    assert "- machine: " in doc and "torch " in doc
    assert re.search(rf"- command: `diloco bench {title} --quick (--\S+ \S+ )*--out ", doc)  # the bench's own flags
    assert "| arm | " in doc and " | tokens/s (median) |" in doc
    for name in arms:
        assert f"| {name} | " in doc


@pytest.mark.slow
def test_strategies_quick(tmp_path: Path) -> None:
    data, doc = bench("strategies", tmp_path, "--model", "llama-2m-fresh")
    names = ["ZERO1", "FULL_SHARD", "FULL_SHARD+cpu-offload"]  # --quick: three of the seven (QUICK_ARMS)
    assert [arm["name"] for arm in data["arms"]] == names
    stages = [arm["deepspeed"].split(" +")[0] for arm in data["arms"]]
    assert stages == ["stage 1", "stage 3", "stage 3"]
    assert "| arm | DeepSpeed ZeRO | tokens/s (median) |" in doc and "| ZERO1 | stage 1 | " in doc
    assert "--model llama-2m-fresh" in data["command"] and data["workload"]["model"].endswith("llama-2m-fresh")
    for arm in data["arms"]:
        assert_measured(arm)
        assert "--nproc_per_node=2" in arm["command"]
        assert len(arm["rank_peak_mb"]) == 2 and all(peak > 50 for peak in arm["rank_peak_mb"])  # both ranks' RSS
    assert data["quick"] is True and data["machine"]["cores"] >= 1
    assert_table(doc, "strategies", names)
    if not data["machine"]["gpus"]:
        assert "no-op on CPU" in doc  # the offload arm says it changes nothing here


@pytest.mark.slow
def test_overhead_quick(tmp_path: Path) -> None:
    data, doc = bench("overhead", tmp_path)
    assert [arm["name"] for arm in data["arms"]] == ["galaxy-1", "diloco-galaxy-2"]
    for arm in data["arms"]:
        assert_measured(arm)
    assert [run["name"] for run in data["runs"]] == ["galaxy-1", "diloco-galaxy-2"] * data["repetitions"]
    assert data["ratio"] == pytest.approx(data["arms"][1]["tokens_per_s"] / data["arms"][0]["tokens_per_s"])
    assert "--hv.galaxy-size 2" in data["arms"][1]["command"]
    assert_table(doc, "overhead", ["galaxy-1", "diloco-galaxy-2"])
    assert "Ratio DiLoCo ÷ alone: **" in doc


@pytest.mark.slow
def test_convergence_quick(tmp_path: Path) -> None:
    """The defaults study: every kind of arm at equal tokens, DiLoCo groups on one model, the gaps to the DDP run
    of the same seed, the no-flags arm training with what the trainer picks (auto), and its verdict."""
    data, doc = bench("convergence", tmp_path, "--data", str(CORPUS))
    arms = {arm["name"]: arm for arm in data["arms"]}
    assert {"single", "ddp", "m1-H5-0.7/0.9", "diloco-H5-auto", "diloco-H5-0.7/0.9"} <= set(arms)
    assert any(name.startswith("trial-") and "inner lr ×2" in name for name in arms)
    fair = [arm for name, arm in arms.items() if name.startswith("trial-ddp")]  # DDP at the trial's smaller batch
    assert len(fair) == 1 and fair[0]["outer"] is None and fair[0]["steps"] == 2 * arms["ddp"]["steps"]
    assert len({arm["tokens"] for arm in data["arms"]}) == 1  # equal tokens in every arm
    for arm in data["arms"]:
        first, last = arm["curve"][0][1], arm["final_eval_loss"][0]
        assert 0 < last < first, arm["name"]  # it learned something from real text
        if arm["groups"] > 1:
            assert arm["groups_identical"], arm["name"]  # DiLoCo groups end on one model
    auto = arms["diloco-H5-auto"]
    w = data["workload"]
    picked = auto_outer(5, 2, w["warmup_steps"], w["steps"])  # what `diloco train` picks with no outer flags
    assert (*auto["outer"], auto["outer_warmup"]) == picked
    assert arms["ddp"]["gap_by_seed"] == [0.0]
    gap = auto["final_eval_loss"][0] / arms["ddp"]["final_eval_loss"][0] - 1
    assert auto["gap_vs_ddp"] == pytest.approx(gap) and auto["worst_gap"] == pytest.approx(gap)
    verdict = data["target"]["by_k"]["2"]
    assert verdict["worst_gap"] == auto["worst_gap"] and verdict["met"] == (gap <= 0.02)
    m1 = arms["m1-H5-0.7/0.9"]["final_eval_loss"][0]
    assert data["m1"]["2"]["vs_single"] == pytest.approx(m1 / arms["single"]["final_eval_loss"][0] - 1)
    assert (tmp_path / "convergence-quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![eval loss](convergence-quick.png)" in doc and "No outer flags (auto) at H = 5" in doc
    assert data["workload"]["corpus"] == str(CORPUS.resolve())  # which text it trained on
    assert f"--data {CORPUS}" in data["command"] and "--study" not in data["command"]


def test_convergence_gaps_are_against_the_best_ddp_and_the_verdict_takes_autos_best() -> None:
    """Of the DDP arms at one k (inner schedules) the one of the lowest mean loss is what every gap at that k is
    measured against, and the verdict judges auto at its best schedule: neither side at a schedule that suits only
    the other."""
    from dataclasses import asdict, replace

    from diloco.bench.convergence import ArmSpec
    from diloco.bench.convergence_report import summarize

    specs = []
    for k in (2, 4):
        ddp, auto = ArmSpec("ddp", k, 1, 8 * k, 10), ArmSpec("diloco-H5-auto", k, k, 8, 10, h=5, outer=(1.0, 0.0))
        specs += [ddp, auto, replace(ddp, name="ddp-lr0.002-wu5", lr=2e-3, warmup_steps=5),
                  replace(auto, name="diloco-H5-auto-lr0.002-wu5", lr=2e-3, warmup_steps=5),
                  replace(auto, name="diloco-H5-auto+group-moment")]  # fmt: skip
    losses = {(2, "ddp"): (2.4, 2.2), (2, "ddp-lr0.002-wu5"): (2.1, 2.2), (2, "diloco-H5-auto"): (2.121, 2.2),
              (2, "diloco-H5-auto-lr0.002-wu5"): (2.3, 2.3), (4, "ddp"): (2.0, 2.0), (4, "ddp-lr0.002-wu5"): (2.0, 2.1),
              (4, "diloco-H5-auto"): (2.1, 1.9), (4, "diloco-H5-auto-lr0.002-wu5"): (2.04, 1.94)}  # fmt: skip
    runs = [asdict(s) | {"seed": seed, "final_eval_loss": losses.get((s.k, s.name), (1.0, 1.0))[seed], "curve": [],
                         "tokens": 1, "groups_identical": True, "wall_s": 1.0}
            for s in specs for seed in (0, 1)]  # fmt: skip
    out = summarize(runs, specs, "defaults")
    assert out["ddp"] == {"2": "ddp-lr0.002-wu5", "4": "ddp"}
    arms = {(a["k"], a["name"]): a for a in out["arms"]}
    assert arms[2, "diloco-H5-auto"]["gap_by_seed"] == pytest.approx([0.01, 0.0])
    assert arms[2, "ddp"]["gap_by_seed"] == pytest.approx([2.4 / 2.1 - 1, 0.0])
    assert arms[4, "diloco-H5-auto"]["gap_by_seed"] == pytest.approx([0.05, -0.05])
    verdict = out["target"]["by_k"]  # the +group-moment arm (loss 1.0) is no auto arm of its own
    assert verdict["2"]["arm"] == "diloco-H5-auto" and verdict["2"]["met"]
    assert verdict["4"]["arm"] == "diloco-H5-auto-lr0.002-wu5" and verdict["4"]["worst_gap"] == pytest.approx(0.02)
    assert verdict["4"]["met"]


@pytest.mark.slow
def test_convergence_map_quick(tmp_path: Path) -> None:
    """The map study: every outer setting at every H against DDP, the best per cell, what auto picks there and
    the worst gap of each rule, in its own JSON and PNG."""
    data, doc = bench("convergence", tmp_path, "--data", str(CORPUS), "--study", "map", stem="convergence-map")
    assert data["study"] == "map" and "--study map" in data["command"]
    cells = {(c["k"], c["h"]): c for c in data["map"]["cells"]}
    assert set(cells) == {(2, 5), (2, 10)}
    ddp = next(a for a in data["arms"] if a["name"] == "ddp")["final_eval_loss"][0]
    for arm in data["arms"]:
        if arm["outer"] is None:
            continue
        cell = cells[arm["k"], arm["h"]]
        rule = "auto" if arm["name"].endswith("-auto") else f"{arm['outer'][0]:g}/{arm['outer'][1]:g}"
        assert cell["gaps"][rule] == pytest.approx(arm["final_eval_loss"][0] / ddp - 1)
    for (k, h), cell in cells.items():
        assert cell["gaps"][cell["best"]] == min(cell["gaps"].values())
        w = data["workload"]
        lr, momentum, warmup = auto_outer(h, k, w["warmup_steps"], w["steps"])  # what `diloco train` picks
        assert cell["auto"] == f"{lr:g}/{momentum:g}" + (f" w{warmup}" if warmup else "")
        assert {"0.7/0.9", "1/0", "1/0.5", "1.4/0", "auto"} <= set(cell["gaps"])  # k = 2 runs two settings more
    worst = data["map"]["worst_gap"]
    assert worst["auto"] == max(c["gaps"]["auto"] for c in cells.values())
    assert list(worst) == ["0.7/0.9", "1/0", "1/0.5", "1.4/0", "auto"]  # the table's columns, in this order
    assert "| k | H | 0.7/0.9 | 1/0 | 1/0.5 | 1.4/0 | auto |" in doc
    assert (tmp_path / "convergence-map-quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Worst gap over every (k, H) of the map" in doc


@pytest.mark.slow
def test_compression_quick(tmp_path: Path) -> None:
    """Every wire format learns, its groups stay identical, and the bytes it puts on the wire per value are what
    the format says: 4 (none), and for the sparse ones a small fraction of int4's 0.5625; the format table
    measures the sparse format on the bench model's shapes."""
    data, doc = bench("compression", tmp_path, "--data", str(CORPUS))
    arms = {arm["name"]: arm for arm in data["arms"]}
    assert list(arms) == ["ddp", "diloco-none", "sparse-1/16-2b", "sparse-1/64-4b"]
    expected = {"none": 4.0}
    for name, arm in arms.items():
        first, last = arm["runs"][0]["curve"][0][1], arm["mean_eval_loss"]
        assert 0 < last < first, name  # it learned something from real text
        if name == "ddp":
            assert arm["bytes_per_value"] is None and arm["gap_vs_ddp"] == 0
            continue
        assert arm["groups_identical"], name
        if name.startswith("sparse"):
            assert arm["bytes_per_value"] < 0.5625 / 4, arm  # a quarter of int4's
            continue
        assert arm["bytes_per_value"] == pytest.approx(expected[arm["compression"]], rel=0.01), arm
        assert abs(arm["gap_vs_none"]) < 0.1, arm  # a lossy wire still trains (the full run measures how well)
    assert arms["diloco-none"]["gap_vs_none"] == 0
    formats = data["formats"]
    assert {f["model"] for f in formats} == {"bench model"} and all(f["fewer_2"] > 8 for f in formats), formats
    # positions by their gaps take fewer bits than plain offsets, except at one value per chunk (a unary bit more)
    assert all(f["positions_bits"] < f["plain_bits"] for f in formats if f["density"] >= 1 / 64), formats
    assert "## compression (quick): " in doc and "| diloco-none | 4.0000 |" in doc and "| sparse-1/16-2b |" in doc
    assert (tmp_path / "compression-quick.png").stat().st_size > 0 and "against bytes per round" in doc
    assert f"--data {CORPUS}" in data["command"]


@pytest.mark.slow
def test_convergence_streaming_quick(tmp_path: Path) -> None:
    """The streaming study: blocking rounds against two fragments, strided and contiguous, blocking and overlapped,
    every arm's groups ending on one model, and each fragment arm's gap to the blocking arm of its seed."""
    data, doc = bench("convergence", tmp_path, "--data", str(CORPUS), "--study", "streaming",
                      stem="convergence-streaming")  # fmt: skip
    arms = {arm["name"]: arm for arm in data["arms"]}
    assert {"ddp", "diloco-H4-auto", "streaming-F2-strided", "streaming-F2-contiguous-T1",
            "streaming-F2-strided-T1-mix0"} <= set(arms)  # fmt: skip
    assert arms["streaming-F2-contiguous-T1"]["layout"] == "contiguous" and arms["streaming-F2-strided-T1"]["overlap"]
    blocking = arms["diloco-H4-auto"]["final_eval_loss"][0]
    for name, arm in arms.items():
        if arm["groups"] > 1:
            assert arm["groups_identical"], name  # the last step's blocking rounds give one model
        if name.startswith("streaming-"):
            assert data["vs_blocking"][name] == pytest.approx(arm["final_eval_loss"][0] / blocking - 1)
    # the strided and contiguous cuts differ, so their losses do
    assert arms["streaming-F2-strided"]["final_eval_loss"] != arms["streaming-F2-contiguous"]["final_eval_loss"]
    assert "Against blocking rounds of the whole model" in doc


def test_convergence_without_a_data_file_is_one_line(tmp_path: Path) -> None:
    """No --data, or one that is no file, or an unknown study: one line naming the flag and exit code 2, before
    torch is imported."""
    cases = [[], ["--data", str(tmp_path / "missing.txt")], ["--data", str(tmp_path)]]
    for flags in [*cases, ["--data", str(CORPUS), "--study", "grid"]]:
        command = [sys.executable, "-X", "importtime", "-m", "diloco", "bench", "convergence", "--quick", *flags]
        result = run_cmd([*command, "--out", str(tmp_path)], timeout=60)
        assert result.returncode == 2, result.output
        said = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
        flag = "--study" if "--study" in flags else "--data"
        assert len(said) == 1 and said[0].startswith("error: ") and flag in said[0], said
        imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line}
        assert "diloco" in imported and not imported & {"torch", "transformers", "hivemind"}, sorted(imported)
    assert not list(tmp_path.glob("*.json"))


def test_strategy_arms_name_their_deepspeed_stage() -> None:
    """All seven arms of the full bench (--quick runs three) and the ZeRO stage each corresponds to."""
    from diloco.bench.strategies import QUICK_ARMS, strategy_arms

    arms = strategy_arms(gpu=False)
    assert [(a.name, a.deepspeed.split(" +")[0]) for a in arms] == [
        ("DDP", "stage 0"), ("ZERO1", "stage 1"), ("NO_SHARD", "stage 0"), ("SHARD_GRAD_OP", "stage 2"),
        ("FULL_SHARD", "stage 3"), ("FULL_SHARD+cpu-offload", "stage 3"), ("FULL_SHARD+grad-ckpt", "stage 3"),
    ]  # fmt: skip
    assert set(QUICK_ARMS) <= {a.name for a in arms}


def test_other_benches_take_no_data_flag() -> None:
    result = run_cmd([str(DILOCO), "bench", "strategies", "--data", str(CORPUS)], timeout=60)
    assert result.returncode == 2 and "--data" in result.stderr, result.output


def test_bench_models_are_the_test_models(tmp_path: Path) -> None:
    """The configs the benches write are those in tests/models, so their results compare with earlier runs."""
    from diloco.bench import models

    for name in models.MODELS:
        written = models.write_model(name, tmp_path)
        assert json.loads((written / "config.json").read_text()) == json.loads(
            (ROOT / "tests" / "models" / name / "config.json").read_text()
        ), name


def test_bench_package_needs_no_checkout() -> None:
    """No bench module reads the checkout's tests/ or the folder beside it: `diloco bench` runs when installed."""
    bench_dir = ROOT / "diloco" / "bench"
    for path in bench_dir.glob("*.py"):
        text = path.read_text()
        for needle in ("tests/", "shared/", '"tests"', '"shared"', "parent.parent"):
            assert needle not in text, (path.name, needle)


def test_bad_bench_is_one_line(tmp_path: Path) -> None:
    for args in (["bench", "nope"], ["bench", "strategies", "--bogus"], ["bench", "allreduce", "--arms", "groups,x"]):
        result = run_cmd([str(DILOCO), *args], timeout=60)
        assert result.returncode == 2, result.output
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert "--arms groups,x" in result.stderr


def test_a_run_of_some_allreduce_arms_writes_its_own_json() -> None:
    from diloco.bench import allreduce

    assert allreduce.stem(False) == "allreduce" and allreduce.stem(True) == "allreduce-quick"
    assert allreduce.stem(False, ["groups", "groups-keyed"]) == "allreduce-groups+groups-keyed"
    out, doc = Path("docs/bench"), Path("docs/benchmarks.md")
    line = benches.command_line("allreduce", False, out, doc, (out, doc), {"arms": ["groups", "groups-keyed"]})
    assert line == "diloco bench allreduce --arms groups,groups-keyed"


def test_a_stop_signal_raises_once_after_a_shielded_section() -> None:
    """SIGHUP inside `stop_on_signals` raises `Stopped`, not inside `shielded` sections (nested here) but once the
    outermost is done; a second signal during the cleanup that follows is dropped; the previous handlers come back."""
    before = {sig: signal.getsignal(sig) for sig in benches.STOP_SIGNALS}
    seen = []
    with pytest.raises(benches.Stopped) as stopped, benches.stop_on_signals():
        try:
            with benches.shielded():
                with benches.shielded():
                    seen.append(f"stopping: {benches.stopping()}")
                    os.kill(os.getpid(), signal.SIGHUP)
                seen.append("shielded section done")
            seen.append("went on after the signal")
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            seen.append(f"cleanup done, stopping: {benches.stopping()}")  # (its processes get a short grace)
    assert stopped.value.signum == signal.SIGHUP and str(stopped.value) == "stopped by SIGHUP"
    assert seen == ["stopping: False", "shielded section done", "cleanup done, stopping: True"]
    assert {sig: signal.getsignal(sig) for sig in benches.STOP_SIGNALS} == before


def test_table_and_quartiles() -> None:
    from diloco.bench import arms, strategies

    assert arms.quartiles([4.0]) == (4.0, 4.0)
    assert arms.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0)
    arm = {"name": "A", "command": "python -m diloco.train", "tokens_per_s": 10.0, "tokens_per_s_iqr": (9.0, 11.0),
           "peak_memory_mb": 100.0, "tree_peak_rss_mb": 200.0, "note": "n", "run_medians": [10.0]}  # fmt: skip
    workload = arms.workload_dict(strategies.strategies_workload(quick=True))
    machine = {"cpu": "X", "cores": 2, "usable_cores": 2, "ram_gib": 1.0, "torch": "t", "python": "p", "gpus": [],
               "load_avg_1m": 0.5}  # fmt: skip
    result = {"bench": "overhead", "quick": False, "date": "D", "machine": machine, "load_avg_1m_end": 0.6,
              "command": "diloco bench overhead", "workload": workload, "arms": [arm, arm | {"name": "B"}],
              "repetitions": 1, "ratio": 1.0, "target": 0.98}  # fmt: skip
    text = arms.markdown(result)
    assert "## overhead: D" in text and "| A | 10 | 9–11 | 100 | - | 200 | n |" in text
    assert "**1.000** (meets the 0.98 target)" in text and "GPU: none" in text
    # per rank, from each run's summary.json: peak RSS on CPU; allocated/reserved on a GPU
    cpu_arm = arm | {"rank_peak_mb": [100.0, 96.4]}
    assert "| A | 10 | 9–11 | 100 | 100, 96 | 200 | n |" in arms.markdown(result | {"arms": [cpu_arm]})
    gpu = result | {"machine": machine | {"gpus": ["H100"]}, "arms": [cpu_arm | {"rank_reserved_mb": [128.0, 130.0]}]}
    text = arms.markdown(gpu)
    assert "per rank: peak allocated / reserved GPU memory (MB)" in text and "| 100, 96/128, 130 |" not in text
    assert "| 100/128, 96/130 |" in text


@pytest.mark.slow
def test_poison_quick(tmp_path: Path) -> None:
    """Every aggregation rule with and without a forged value and a forged weight (the quick run's two attacks), at
    equal honest tokens: the scaled attack drags the mean far off, the gaps are against the same seed's attack-free
    arms, groups stay on one model, and the verdict follows the worst gap."""
    data, doc = bench("poison", tmp_path, "--data", str(CORPUS))
    arms = {arm["name"]: arm for arm in data["arms"]}
    assert data["attacks"] == ["scaled", "heavy"]  # the quick run's (the full one adds sign-flip and noise)
    assert set(arms) == {f"{rule}/{attack}" for rule in ("mean", "trimmed-mean", "centered-clip")
                         for attack in ("none", "scaled", "heavy")}  # fmt: skip
    assert all(arm["groups_identical"] for arm in data["arms"])
    assert [arm["groups"] for arm in data["arms"][:2]] == [4, 5]  # the attacker is a fifth group
    clean = arms["mean/none"]["final_eval_loss"][0]
    for arm in data["arms"]:
        assert arm["gap_vs_mean"] == pytest.approx(arm["final_eval_loss"][0] / clean - 1), arm["name"]
    assert arms["mean/scaled"]["gap_vs_mean"] > 0.05  # 50x its pseudo-gradient moves the mean
    for rule, verdict in data["verdicts"].items():
        worst = max(arms[f"{rule}/{a}"]["gap_vs_mean"] for a in ("scaled", "heavy"))
        assert verdict["worst_gap_under_attack"] == pytest.approx(worst) and verdict["met"] == (worst <= 0.02)
    assert (tmp_path / "poison-quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## poison (quick): " in doc and "| trimmed-mean | scaled |" in doc and "poison-quick.png" in doc

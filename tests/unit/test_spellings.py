"""The habits users bring, parsed in process: OpenDiLoCo's train_fsdp.py flags (renamed, translated or refused with one
line), a TOML file through every command that trains, and the line a token-budget group leaves with when its batch
differs from the swarm's."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.cli.app import build_app, run_app
from diloco.config import Config
from diloco.outer.agreement import mismatch_error, schedule
from diloco.swarm.records.fingerprint import ModelId
from diloco.swarm.records.status import Status
from tests.support.parse import parse, usage_error
from tests.support.paths import TINY_MODEL

BASE = ["--path-model", "m", "--fake-data"]


@pytest.mark.parametrize(
    "old, new",
    [
        (["--dataset-name-or-path", "data/c4.txt"], {"dataset": Path("data/c4.txt"), "fake_data": False}),
        (["--dataset-name-or-path=data/c4.txt"], {"dataset": Path("data/c4.txt"), "fake_data": False}),
        (["--c4-tiny"], {"dataset": Path("PrimeIntellect/c4-tiny"), "dataset_config": "en", "fake_data": False}),
        (["--c4-tiny", "true"], {"dataset": Path("PrimeIntellect/c4-tiny"), "dataset_config": "en",
                                 "fake_data": False}),  # fmt: skip
        (["--hv.timeout-waiting-for-peers", "12.5"], {"hv.matchmaking_time": 12.5}),
        (["--hv.hivemind-compression", "fp16"], {"hv.compression": "fp16"}),
        (["--hv.hivemind-compression", "uniform8bit"], {"hv.compression": "int8"}),
        (["--attn-implementation", "sdpa"], {"attn_implementation": "sdpa"}),
        (["--ckpt.topk", "3"], {"ckpt.topk": 3}),
    ],
)
def test_opendilocos_flags_that_mean_something_here_are_taken(old: list[str], new: dict[str, object]) -> None:
    data = [] if "fake_data" in new else ["--fake-data"]
    config = parse(["--path-model", "m", *data, *old])
    for field, value in new.items():
        holder = config
        for part in field.split(".")[:-1]:
            holder = getattr(holder, part)
        assert getattr(holder, field.split(".")[-1]) == value, field


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--num-workers", "4"], "--num-workers (OpenDiLoCo): data is tokenized once"),
        (["--log-activations-steps", "10"], "--log-activations-steps (OpenDiLoCo): activations are not logged"),
        (["--hv.all-reduce-strategy", "WAIT_FOR_ALL"], "--hv.all-reduce-strategy (OpenDiLoCo): a round closes"),
        (["--hv.fail-rank-drop"], "--hv.fail-rank-drop (OpenDiLoCo): a group whose round fails applies nothing"),
        (["--hv.hivemind-compression", "blockwise8bit"], "use --hv.compression fp16, int8 or int4"),
    ],
)
def test_opendilocos_flags_without_a_meaning_here_are_one_line_saying_what_to_do(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in usage_error([*BASE, *flags], capsys)


def test_a_whole_opendiloco_launch_line_parses() -> None:
    """Seed 002's train_fsdp.py line, with `-m diloco.train` in its place, and the flags its README lists."""
    config = parse(
        "--path-model PrimeIntellect/llama-150m-fresh --dataset-name-or-path allenai/c4 --attn-implementation sdpa "
        "--per-device-train-batch-size 32 --total-batch-size 512 --lr 4e-4 --warmup-steps 1000 --total-steps 88000 "
        "--precision bf16-mixed --sharding-strategy NO_SHARD --project hivemind_debug --metric-logger-type wandb "
        "--ckpt.interval 100 --ckpt.path outputs --ckpt.topk 2 --hv.local-steps 500 --hv.outer-lr 0.7 "
        "--hv.galaxy-size 2 --hv.world-rank 1 --hv.matchmaking-time 10 --hv.averaging-timeout 60 "
        "--hv.hivemind-compression fp16 --hv.skip-load-from-peers "
        "--hv.initial-peers /ip4/127.0.0.1/tcp/30001/p2p/12D3KooWSShrJm4CSvrqkmVgos7VPu8p47kbbw2i8PgUB4EuDHv6".split()
    )
    assert config.dataset == Path("allenai/c4") and config.hv.compression == "fp16" and config.ckpt.topk == 2
    assert config.max_steps == 88000 and config.hv.outer_lr == 0.7 and config.sharding_strategy == "NO_SHARD"


# ---------------------------------------------------------------- a TOML file, through every command that trains


def toml(tmp_path: Path) -> Path:
    """A flat file, as `python -m diloco.train --config` takes it."""
    file = tmp_path / "run.toml"
    file.write_text(f'path-model = "{TINY_MODEL}"\nfake-data = true\nmax-steps = 11\nper-device-train-batch-size '
                    '= 2\ntotal-batch-size = 2\n[hv]\nlocal-steps = 7\n')  # fmt: skip
    return file


def test_diloco_train_takes_the_flat_file_that_python_m_diloco_train_takes(tmp_path: Path) -> None:
    seen: list[Config] = []
    assert run_app(build_app(train_fn=lambda config: seen.append(config) or 0), ["train", "--config",
                                                                                 str(toml(tmp_path))]) == 0  # fmt: skip
    assert seen[0].max_steps == 11 and seen[0].hv.local_steps == 7 and seen[0].path_model == TINY_MODEL


def test_a_file_that_keeps_the_flags_under_a_train_table_still_works(tmp_path: Path) -> None:
    file = tmp_path / "run.toml"
    file.write_text(f'[train]\npath-model = "{TINY_MODEL}"\nfake-data = true\nmax-steps = 5\n')
    seen: list[Config] = []
    assert run_app(build_app(train_fn=lambda config: seen.append(config) or 0), ["train", "--config", str(file)]) == 0
    assert seen[0].max_steps == 5


def test_the_train_help_says_how_to_give_a_config_file(capsys: pytest.CaptureFixture[str]) -> None:
    run_app(build_app(), ["train", "--help"])
    assert "--config FILE.toml" in capsys.readouterr().out


def test_diloco_launch_passes_the_config_file_to_its_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`diloco launch --workers 2 -- --config run.toml`: the file is the groups', not the launcher's."""
    launched: list[tuple[Config, list[str], int]] = []
    monkeypatch.setattr("diloco.launch.launch", lambda config, args, workers, nproc: launched.append(
        (config, args, workers)) or 0)  # fmt: skip
    file = toml(tmp_path)
    assert run_app(build_app(), ["launch", "--workers", "2", "--", "--config", str(file)]) == 0
    config, args, workers = launched[0]
    assert config.max_steps == 11 and args == ["--config", str(file)] and workers == 2


def test_diloco_slurm_passes_the_config_file_to_its_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = toml(tmp_path)
    assert run_app(build_app(), ["slurm", "--groups", "2", "--output", str(tmp_path / "out"), "--", "--config",
                                 str(file)]) == 0  # fmt: skip
    script = capsys.readouterr().out
    assert f"--config {file}" in script and "--hv.galaxy-size 2" in script


# ---------------------------------------------------------------- a token budget's groups of another batch


def budget_status(batch: str, budget: tuple[int, int], warmup: int) -> Status:
    return Status(world_rank=0, ranks=1, sharding="FULL_SHARD", state="training", step=5, max_steps=100,
                  outer_step=1, tokens_per_s=1.0, digest="", round_peers=None, round_at=None, heard_at=1.0,
                  model="fp", parameters=10, peer="peer-0", transport="tcp", outer=f"1.4/0 w{warmup}",
                  schedule=schedule(100, 500, budget), batch=batch)  # fmt: skip


def test_a_token_budget_group_of_another_batch_is_told_the_budget_flag_not_the_outer_lr() -> None:
    """Groups of any batch share one token budget; a group whose own N differs (and so, under auto, its outer
    warm-up) is told the budget's flag, the one the user really set differently."""
    other = budget_status("16x128", (65536, 10), warmup=0)
    mine = budget_status("32x128", (131072, 10), warmup=2)
    error = mismatch_error(other, ModelId("fp", 10), mine.outer, mine.schedule, mine.batch).within("hv")
    line = str(error.spelled(lambda field: "--" + field.replace("_", "-")))
    assert line.startswith("--hv.target-tokens") and "outer-lr" not in line, line

"""Configuration and command-line parsing, in process (no torch.distributed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.cli.app import _one_line, as_flags, build_app, run_app
from diloco.config import Config
from diloco.errors import FieldError, RankUsageError, UsageError
from diloco.outer.auto import outer_setting
from tests.support.parse import parse, usage_error
from tests.support.paths import TINY_MODEL


def test_seed_flag_names_parse() -> None:
    config = parse(
        "--path-model m --fake-data --seq-length 64 --per-device-train-batch-size 4 --total-batch-size 16 --lr 1e-2 "
        "--warmup-steps 3 --total-steps 7 --precision fp16-mixed --sharding-strategy SHARD_GRAD_OP "
        "--gradient-checkpointing --no-torch-compile --metric-logger-type wandb --project p --seed 3 "
        "--eval-interval 5 --eval-steps 2 --run-dir r --ckpt.interval 4 --ckpt.path c --ckpt.resume latest "
        "--hv.initial-peers /ip4/127.0.0.1/tcp/1/p2p/12D3KooWSShrJm4CSvrqkmVgos7VPu8p47kbbw2i8PgUB4EuDHv6 "
        "/dns/example.org/tcp/2 --hv.galaxy-size 3 --hv.world-rank 2 --hv.local-steps 25 --hv.outer-lr 1.0 "
        "--hv.outer-momentum 0.0 --hv.matchmaking-time 2 --hv.averaging-timeout 30 --hv.skip-load-from-peers "
        "--hv.compression fp16 --hv.run-id exp1".split()
    )
    assert config.max_steps == 7 and config.precision == "fp16-mixed" and not config.torch_compile
    assert config.sharding_strategy == "SHARD_GRAD_OP" and config.gradient_checkpointing
    assert config.ckpt.interval == 4 and config.ckpt.path == Path("c") and config.ckpt.resume == "latest"
    assert len(config.hv.initial_peers) == 2 and config.hv.galaxy_size == 3 and config.hv.world_rank == 2
    assert config.hv.compression == "fp16" and config.hv.skip_load_from_peers and config.hv.run_id == "exp1"


def test_max_steps_alias() -> None:
    assert parse(["--path-model", "m", "--fake-data", "--max-steps", "9"]).max_steps == 9
    assert parse(["--path-model", "m", "--fake-data", "--total-steps", "9"]).max_steps == 9


def test_repeated_flag_last_wins_like_argparse() -> None:
    config = parse("--path-model m --fake-data --lr 1 --lr 2 --hv.initial-peers /ip4/1.2.3.4/tcp/1".split())
    assert config.lr == 2 and config.hv.initial_peers == ["/ip4/1.2.3.4/tcp/1"]


def test_toml_config_and_command_line_wins(tmp_path: Path) -> None:
    file = tmp_path / "run.toml"
    file.write_text('path-model = "from-file"\nfake-data = true\nmax-steps = 11\nlr = 0.5\n[ckpt]\ninterval = 3\n')
    config = parse(["--config", str(file), "--max-steps", "4"])
    assert config.path_model == Path("from-file") and config.fake_data
    assert config.max_steps == 4 and config.lr == 0.5 and config.ckpt.interval == 3


def test_unknown_key_in_toml_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "run.toml"
    file.write_text('path-model = "m"\nfake-data = true\nbogus = 1\n')
    with pytest.raises(SystemExit) as exit_info:
        parse(["--config", str(file)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "bogus" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("world_size", "per_device", "total", "accum"), [(1, 4, 16, 4), (2, 4, 16, 2), (4, 4, 16, 1), (2, 3, 6, 1)]
)
def test_grad_accumulation(world_size: int, per_device: int, total: int, accum: int) -> None:
    config = Config(
        path_model=TINY_MODEL, fake_data=True, per_device_train_batch_size=per_device, total_batch_size=total
    )
    assert config.grad_accumulation(world_size) == accum


def test_indivisible_batch_names_the_flags() -> None:
    config = Config(path_model=TINY_MODEL, fake_data=True, per_device_train_batch_size=4, total_batch_size=16)
    with pytest.raises(UsageError, match="--total-batch-size 16 .* 4 × 3 ranks"):
        config.grad_accumulation(3)


def test_validation_error_becomes_one_line_naming_the_flag() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        Config(path_model=TINY_MODEL, fake_data=True, hv={"initial_peers": ["/ip4/1.2.3/tcp/x"]})
    line = _one_line(info.value)
    assert line.startswith("--hv.initial-peers:") and "\n" not in line


def test_world_rank_must_be_below_galaxy_size() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="--hv.world-rank 2 must be smaller than --hv.galaxy-size 2"):
        Config(path_model=TINY_MODEL, fake_data=True, hv={"galaxy_size": 2, "world_rank": 2})


def test_ddp_strategies_parse_and_refuse_cpu_offload() -> None:
    from pydantic import ValidationError

    assert parse(["--path-model", str(TINY_MODEL), "--fake-data", "--sharding-strategy", "ZERO1"]).sharding_strategy \
        == "ZERO1"  # fmt: skip
    with pytest.raises(ValidationError, match="--cpu-offload needs an FSDP --sharding-strategy; DDP keeps"):
        Config(path_model=TINY_MODEL, fake_data=True, sharding_strategy="DDP", cpu_offload=True)


def test_a_field_error_is_spelled_by_the_command_line() -> None:
    """Lower layers name config fields; the layer that handed out a slice prefixes it; the CLI spells flags."""
    error = FieldError("{world_rank} 4 is taken; ask {ckpt.resume} or {run_dir} ({not a field})", per_rank=True)
    assert error.fields == ["world_rank", "ckpt.resume", "run_dir"]
    assert str(error) == "world_rank 4 is taken; ask ckpt.resume or run_dir ({not a field})"
    spelled = as_flags(error.within("hv"))
    assert isinstance(spelled, RankUsageError)
    assert str(spelled) == "--hv.world-rank 4 is taken; ask --hv.ckpt.resume or --hv.run-dir ({not a field})"
    assert type(as_flags(FieldError("{dataset} x"))) is UsageError
    # a field of the whole config handed to a slice as a plain value keeps its name under the slice's prefix
    rooted = FieldError("{/max_steps} 200 here, {local_steps} 25").within("hv")
    assert rooted.fields == ["max_steps", "hv.local_steps"] and str(rooted) == "max_steps 200 here, hv.local_steps 25"
    assert str(as_flags(rooted)) == "--max-steps 200 here, --hv.local-steps 25"


def test_inner_optimizer_flags_default_to_todays_values_and_parse() -> None:
    default = parse(["--path-model", "m", "--fake-data"])
    assert default.max_grad_norm == 1.0 and default.weight_decay == 0.1 and default.adam_betas == (0.9, 0.95)
    seed_004 = parse("--path-model m --fake-data --max-grad-norm 0.3 --weight-decay 0 --adam-betas 0.8 0.99".split())
    assert seed_004.max_grad_norm == 0.3 and seed_004.weight_decay == 0.0 and seed_004.adam_betas == (0.8, 0.99)


@pytest.mark.parametrize(
    "argv, flag",
    [
        ("--adam-betas 0.9 1.0", "--adam-betas"),
        ("--adam-betas 0.9", "--adam-betas"),
        ("--max-grad-norm -1", "--max-grad-norm"),
        ("--weight-decay -0.1", "--weight-decay"),
    ],
)
def test_bad_optimizer_flags_are_one_line_naming_the_flag(
    argv: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert flag in usage_error(["--path-model", "m", "--fake-data", *argv.split()], capsys)


SWARM = "--path-model m --fake-data --warmup-steps 20 --hv.galaxy-size"


@pytest.mark.parametrize(
    "flags, max_steps, expected",
    [
        ("2", 25_000, (0.7, 0.9, 0)),  # H = 500 by default; 50 outer steps or more: the paper's setting
        ("2", 4_000, (1.0, 0.0, 0)),  # 8 outer steps of H = 500: no momentum, no warm-up above H = 100
        ("2 --hv.local-steps 25", 200, (1.4, 0.0, 3)),  # 3 outer steps cover 3 inner warm-ups of 20 steps
        ("4 --hv.local-steps 25", 200, (1.3, 0.0, 3)),  # 3+ groups up to H = 25 (with the galaxy moment): 1.3
        ("3 --hv.local-steps 26", 260, (1.2, 0.0, 3)),  # above H = 25: 1.2
        ("8 --hv.local-steps 10", 200, (1.3, 0.0, 6)),
        ("4 --hv.local-steps 25", 1250, (0.7, 0.9, 0)),  # 50 outer steps: momentum pays off
        ("4 --hv.local-steps 25", 1249, (1.3, 0.0, 3)),  # 49: still none
        ("8 --hv.local-steps 100", 2000, (1.2, 0.0, 0)),  # ⌈60 / 100⌉ = 1 outer step of warm-up is none
        ("2 --hv.local-steps 50", 2000, (1.4, 0.0, 2)),  # 40 outer steps, a warm-up of ⌈60 / 50⌉
        ("4 --hv.local-steps 101", 2100, (1.0, 0.0, 0)),  # above H = 100: 1.0, no warm-up
        ("2 --hv.local-steps 60", 600, (1.4, 0.0, 0)),  # ⌈60 / 60⌉ = 1 outer step of warm-up is none
        # 3 inner warm-ups would span all 30 outer steps: at most 3 of every 8, ⌈30 · 3 / 8⌉
        ("2 --hv.local-steps 100 --warmup-steps 1000", 3000, (1.4, 0.0, 12)),
        ("4 --hv.local-steps 25 --warmup-steps 150", 200, (1.3, 0.0, 3)),  # ⌈18⌉ capped at ⌈8 · 3 / 8⌉
        ("2 --hv.local-steps 25", 50, (1.4, 0.0, 3)),  # 2 outer steps (the demo): never capped below 3
        ("4 --hv.local-steps 101", 1000, (1.0, 0.0, 0)),
        ("4 --hv.local-steps 25 --hv.outer-lr 0.7 --hv.outer-momentum 0.9 --hv.outer-lr-warmup 0", 200, (0.7, 0.9, 0)),
        ("2 --hv.local-steps 25 --hv.outer-momentum 0.5", 200, (1.4, 0.5, 3)),  # each on its own
        ("4 --hv.local-steps 25 --hv.outer-lr-warmup 5", 200, (1.3, 0.0, 5)),
        ("2 --hv.outer-lr auto --hv.outer-momentum 0.0", 50_000, (0.7, 0.0, 0)),
        # the token budget: the H of equal groups, 2048 tokens per step each: 102400 / 2 / 2048 = 25
        ("2 --hv.target-tokens 102400", 200, (1.4, 0.0, 3)),
        ("2 --hv.target-tokens 1024000", 2000, (1.0, 0.0, 0)),  # H = 250, 8 outer steps
        ("4 --hv.target-tokens 204800", 200, (1.3, 0.0, 3)),  # 204800 / 4 / 2048 = 25
    ],
)
def test_outer_auto_picks_by_h_galaxy_warmup_and_length_and_set_values_win(
    flags: str, max_steps: int, expected: tuple
) -> None:
    config = parse(f"{SWARM} {flags}".split())
    assert outer_setting(config, tokens_per_step=2048, max_steps=max_steps) == expected
    assert config.hv.outer_is_auto() == (flags.count("--hv.outer-") < 3)


def test_outer_bad_values_are_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    said = usage_error(["--path-model", "m", "--fake-data", "--hv.outer-lr", "-1"], capsys)
    assert "--hv.outer-lr: Input should be greater than 0, or 'auto' (got '-1')" in said
    said = usage_error(["--path-model", "m", "--fake-data", "--hv.outer-momentum", "1"], capsys)
    assert "--hv.outer-momentum: Input should be less than 1, or 'auto' (got '1')" in said
    said = usage_error(["--path-model", "m", "--fake-data", "--hv.outer-lr-warmup", "-2"], capsys)
    assert "--hv.outer-lr-warmup: Input should be greater than or equal to 0, or 'auto' (got '-2')" in said


def test_swarm_flags_a_lone_group_does_not_use_are_named() -> None:
    lone = parse("--path-model m --fake-data --hv.local-steps 5 --hv.compression fp16 --hv.world-rank 0".split())
    assert lone.hv.unused_alone() == ["local_steps", "compression"]  # the world rank still names the run folder
    assert parse(["--path-model", "m", "--fake-data"]).hv.unused_alone() == []
    swarm = parse("--path-model m --fake-data --hv.galaxy-size 2 --hv.local-steps 5".split())
    assert swarm.hv.unused_alone() == []


def test_dht_takes_hivemind_dht_spellings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hivemind-dht --identity_path ... --host_maddrs ... --announce_maddrs ...` scripts work with `diloco dht`."""
    from diloco.swarm.records import dht

    served = []
    monkeypatch.setattr(dht, "serve_dht", lambda *args, **kwargs: served.append((args, kwargs)) or 0)
    argv = ["dht", "--identity_path", str(tmp_path / "id.pem"), "--host_maddrs", "/ip4/127.0.0.1/tcp/3101",
            "--announce_maddrs", "/ip4/10.0.0.1/tcp/3101"]  # fmt: skip
    assert run_app(build_app(), argv) == 0
    from diloco.swarm.rounds import reachability

    # (and it dials joining ranks back: they learn whether they can be dialled; no relay unless asked)
    (args, kwargs), = served
    assert args == (tmp_path / "id.pem", ["/ip4/127.0.0.1/tcp/3101"], ["/ip4/10.0.0.1/tcp/3101"])
    (service,) = kwargs["services"]
    assert service.func is reachability.serve and service.keywords == {"relay_port": None}


def test_dht_relays_on_the_ports_given_and_refuses_ranges_it_cannot_use(tmp_path: Path, capsys, monkeypatch) -> None:
    """--relay-ports FIRST-LAST: the relay listens on FIRST while the DHT peer serves (joining ranks hear of it at
    dial-back) and is closed after; a range of fewer than two ports, or outside 1024..65535, or a control port in
    use: one line naming the flag, exit 2."""
    import socket

    from diloco.swarm.records import dht

    with socket.create_server(("127.0.0.1", 0)) as probe:
        first = probe.getsockname()[1]
    seen = []

    def serve(*args, **kwargs):
        (service,) = kwargs["services"]
        with socket.create_connection(("127.0.0.1", first), timeout=5):  # the relay listens while it serves
            seen.append(service.keywords)
        return 0

    monkeypatch.setattr(dht, "serve_dht", serve)
    argv = ["dht", "--identity", str(tmp_path / "id.pem"), "--relay-ports", f"{first}-{first + 3}"]
    assert run_app(build_app(), argv) == 0 and seen == [{"relay_port": first}]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", first), timeout=5).close()  # closed with the DHT peer

    def refused(spec: str) -> str:
        with pytest.raises(SystemExit) as exited:
            run_app(build_app(), ["dht", "--identity", str(tmp_path / "id.pem"), "--relay-ports", spec])
        assert exited.value.code == 2
        return capsys.readouterr().err

    for bad in ["40000", "40001-40000", "80-90", "65535-65536", "a-b"]:
        assert f"--relay-ports {bad}: give FIRST-LAST" in refused(bad)
    with socket.create_server(("0.0.0.0", 0)) as taken:
        port = taken.getsockname()[1]
        assert f"--relay-ports {port}-{port + 1}: cannot listen on port {port}" in refused(f"{port}-{port + 1}")
    assert seen == [{"relay_port": first}]  # nothing served after bad input


def test_lora_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """--lora-r turns LoRA on with peft's defaults (every linear layer but the head); the other --lora-* flags need it;
    the target modules are a list."""
    base = ["--path-model", str(TINY_MODEL), "--fake-data"]
    assert not parse(base).lora
    config = parse([*base, "--lora-r", "8"])
    assert config.lora and config.lora_r == 8 and config.lora_target_modules == ["all-linear"]
    assert config.lora_alpha is None and config.lora_dropout == 0 and not config.lora_merge
    config = parse([*base, "--lora-r", "4", "--lora-alpha", "16", "--lora-target-modules", "q_proj", "v_proj",
                    "--lora-dropout", "0.05", "--lora-merge"])  # fmt: skip
    assert config.lora_target_modules == ["q_proj", "v_proj"] and config.lora_alpha == 16 and config.lora_merge
    assert config.lora_dropout == 0.05
    assert "--lora-alpha sets up LoRA adapters: pass --lora-r R too" in usage_error([*base, "--lora-alpha", "16"], capsys)
    assert "--lora-merge sets up LoRA adapters" in usage_error([*base, "--lora-merge"], capsys)
    assert "--lora-dropout" in usage_error([*base, "--lora-r", "4", "--lora-dropout", "1"], capsys)
    assert "--lora-r" in usage_error([*base, "--lora-r", "-1"], capsys)


def test_quantized_base_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """--load-in-4bit / --load-in-8bit quantize a LoRA run's base, which is then not sharded: DDP unless ZERO1 is
    given; everything that cannot go with it is one line naming the flag."""
    base = ["--path-model", str(TINY_MODEL), "--fake-data", "--lora-r", "4"]
    assert parse(base).quantized_bits is None and parse(base).sharding_strategy == "FULL_SHARD"
    config = parse([*base, "--load-in-4bit"])
    assert config.quantized_bits == 4 and config.sharding_strategy == "DDP"
    config = parse([*base, "--load-in-8bit", "--sharding-strategy", "ZERO1"])
    assert config.quantized_bits == 8 and config.sharding_strategy == "ZERO1"
    refused = {
        "pass either --load-in-4bit or --load-in-8bit, not both": [*base, "--load-in-4bit", "--load-in-8bit"],
        "--load-in-4bit quantizes the frozen base under LoRA adapters: pass --lora-r R too": [*base[:3],
                                                                                               "--load-in-4bit"],
        "--load-in-8bit: FSDP cannot shard a quantized base (FULL_SHARD)": [*base, "--load-in-8bit",
                                                                            "--sharding-strategy", "FULL_SHARD"],
        "--load-in-4bit: the quantized base stays on the device, unsharded: drop --cpu-offload": [
            *base, "--load-in-4bit", "--cpu-offload"],
        "--lora-merge: a 4-bit base has no full-precision weights": [*base, "--load-in-4bit", "--lora-merge"],
    }  # fmt: skip
    for said, argv in refused.items():
        assert said in usage_error(argv, capsys), argv


def test_sparse_round_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """--hv.compression sparse with its density, value bits and outer rule; each refusal is one line naming the flag
    (``usage_error``: exit 2)."""
    base = ["--path-model", str(TINY_MODEL), "--fake-data", "--hv.galaxy-size", "2"]
    config = parse([*base, "--hv.compression", "sparse"])
    assert (config.hv.sparse_density, config.hv.sparse_bits, config.hv.error_feedback()) == (1 / 64, 2, 0.95)
    config = parse([*base, "--hv.compression", "sparse", "--hv.sparse-density", "0.01", "--hv.sparse-bits", "4",
                    "--hv.sparse-rule", "nesterov", "--hv.outer-momentum", "0.9"])  # fmt: skip
    assert (config.hv.sparse_density, config.hv.sparse_bits, config.hv.error_feedback()) == (0.01, 4, 1.0)
    assert parse(base).hv.error_feedback() is None
    sparse = [*base, "--hv.compression", "sparse"]
    refused = {
        "--hv.sparse-density": [*sparse, "--hv.sparse-density", "0"],
        "--hv.sparse-density ": [*sparse, "--hv.sparse-density", "1.5"],
        "--hv.sparse-bits": [*sparse, "--hv.sparse-bits", "3"],
        "--hv.sparse-density is a setting of sparse rounds: add --hv.compression sparse": [
            *base, "--hv.sparse-density", "0.1"],
        "--hv.aggregation trimmed-mean has no sparse form": [*sparse, "--hv.galaxy-size", "3", "--hv.aggregation",
                                                              "trimmed-mean"],
        "--hv.outer-momentum 0.9: under --hv.sparse-rule sparseloco the error buffer is the momentum": [
            *sparse, "--hv.outer-momentum", "0.9"],
    }  # fmt: skip
    for said, argv in refused.items():
        error = usage_error(argv, capsys)
        assert said.strip() in error and len(error.strip().splitlines()) == 1, (argv, error)

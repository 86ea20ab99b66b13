"""A DeepSpeed user's habits, in process: ``--deepspeed ds_config.json`` read as this trainer's flags (each key that
means something here, "auto", flags beside the file winning, DeepSpeed's batch rule, the refusals and the one warning
line), bad files as one line and exit 2, the deepspeed launcher's ``--local_rank`` ignored, and the seeds' configs
starting the same training as the flags written by hand."""

from __future__ import annotations

import faulthandler
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diloco.cli.app import build_app, run_app
from diloco.cli.deepspeed import to_flags
from diloco.config import Config
from diloco.errors import UsageError
from tests.support.parse import parse, usage_error
from tests.support.paths import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "deepspeed"
# seed 004's "Example DeepSpeed Configuration" block, copied as it is: ZeRO-2, bf16, optimizer offload to CPU,
# 16 accumulation steps, the micro batch left to the trainer ("auto")
SEED004 = FIXTURES / "seed004.json"
# seed 003 shows no JSON: this is the file its ZeRO-2 run (`deepspeed --num_gpus=$NUM_GPUS real_model_example.py
# --model gpt2-medium --strategy zero2 --batch_size 4 --epochs 3`) would hold, written from its prose: ZeRO stage 2,
# a micro batch of 4 per GPU, and the AdamW lr its expected output prints ("LR: 5.00e-05")
SEED003 = FIXTURES / "seed003_zero2.json"
BASE = ["--path-model", "m", "--fake-data"]


def flags(ds: dict[str, Any], argv: list[str] | None = None, world_size: int = 1) -> list[str]:
    return to_flags(ds, argv or [], world_size)[0]


def warning(ds: dict[str, Any], argv: list[str] | None = None) -> str | None:
    return to_flags(ds, argv or [], 1)[1]


def refusal(ds: dict[str, Any], argv: list[str] | None = None, world_size: int = 1) -> str:
    with pytest.raises(UsageError) as refused:
        to_flags(ds, argv or [], world_size)
    return str(refused.value)


def ds_file(tmp_path: Path, ds: Any, name: str = "ds_config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(ds))
    return path


# ---------------------------------------------------------------- each key


@pytest.mark.parametrize(
    "ds, expected",
    [
        ({"zero_optimization": {"stage": 0}}, ["--sharding-strategy", "DDP"]),
        ({"zero_optimization": {"stage": 1}}, ["--sharding-strategy", "ZERO1"]),
        ({"zero_optimization": {"stage": 2}}, ["--sharding-strategy", "SHARD_GRAD_OP"]),
        ({"zero_optimization": {"stage": 3}}, ["--sharding-strategy", "FULL_SHARD"]),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}},
         ["--sharding-strategy", "FULL_SHARD", "--cpu-offload"]),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
         ["--sharding-strategy", "FULL_SHARD", "--cpu-offload"]),
        ({"bf16": {"enabled": True}}, ["--precision", "bf16-mixed"]),
        ({"bfloat16": {"enabled": True}}, ["--precision", "bf16-mixed"]),
        ({"fp16": {"enabled": True, "loss_scale": 0}}, ["--precision", "fp16-mixed"]),
        ({"bf16": {"enabled": False}, "fp16": {"enabled": False}}, []),  # neither: the flag's default
        ({"gradient_clipping": 0.3}, ["--max-grad-norm", "0.3"]),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.98], "eps": 1e-8,
                                                     "weight_decay": 0.01}}},
         ["--lr", "0.0003", "--adam-betas", "0.9", "0.98", "--weight-decay", "0.01"]),
        ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}, ["--lr", "0.001"]),  # adam_w_mode true by default
        ({"optimizer": {"type": "adam", "params": {"lr": 1e-3, "adam_w_mode": True}}}, ["--lr", "0.001"]),
        ({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 100, "total_num_steps": 5000,
                                                              "warmup_type": "linear"}}},
         ["--warmup-steps", "100", "--max-steps", "5000"]),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 90,
                                                             "warmup_max_lr": 2e-4}}},
         ["--warmup-steps", "10", "--max-steps", "90", "--lr", "0.0002"]),
        ({"activation_checkpointing": {"partition_activations": False}}, ["--gradient-checkpointing"]),
    ],
)  # fmt: skip
def test_each_key_that_means_something_here_becomes_its_flag(ds: dict[str, Any], expected: list[str]) -> None:
    assert flags(ds) == expected


def test_the_flags_a_file_maps_to_are_what_the_trainer_receives(tmp_path: Path) -> None:
    ds = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": 2,
          "gradient_accumulation_steps": 3, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.9],
                                                                                      "weight_decay": 0.0}},
          "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 7, "total_num_steps": 70}},
          "fp16": {"enabled": True}, "activation_checkpointing": {}}  # fmt: skip
    config = parse([*BASE, "--deepspeed", str(ds_file(tmp_path, ds))])
    assert (config.sharding_strategy, config.max_grad_norm, config.precision) == ("SHARD_GRAD_OP", 0.5, "fp16-mixed")
    assert (config.per_device_train_batch_size, config.total_batch_size) == (2, 6)
    assert (config.lr, config.adam_betas, config.weight_decay) == (1e-3, (0.8, 0.9), 0.0)
    assert (config.warmup_steps, config.max_steps, config.gradient_checkpointing) == (7, 70, True)


def test_auto_leaves_every_flag_as_it_is() -> None:
    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
          "zero_optimization": {"stage": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "warmup_num_steps": "auto", "warmup_type": "linear"}}}  # fmt: skip
    assert flags(ds) == []


def test_flags_given_beside_the_file_win(tmp_path: Path) -> None:
    ds = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "gradient_clipping": 0.3,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5, "total_num_steps": 50}}}  # fmt: skip
    given = ["--precision", "32-true", "--sharding-strategy", "FULL_SHARD", "--lr=2e-3", "--total-steps", "9"]
    assert flags(ds, given) == ["--max-grad-norm", "0.3", "--warmup-steps", "5"]
    config = parse([*BASE, "--deepspeed", str(ds_file(tmp_path, ds)), *given])
    assert (config.precision, config.sharding_strategy, config.lr, config.max_steps) == ("32-true", "FULL_SHARD",
                                                                                          2e-3, 9)  # fmt: skip
    assert config.max_grad_norm == 0.3 and config.warmup_steps == 5


def test_a_flag_beside_the_file_settles_the_refusal_of_the_key_it_replaces() -> None:
    both = {"bf16": {"enabled": True}, "fp16": {"enabled": True}}
    assert "bf16.enabled and fp16.enabled are both true" in refusal(both)
    assert flags(both, ["--precision", "32-true"]) == []
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert flags(offload, ["--no-cpu-offload"]) == ["--sharding-strategy", "SHARD_GRAD_OP"]


# ---------------------------------------------------------------- the batch: micro × accumulation × ranks


@pytest.mark.parametrize(
    "ds, world_size, per_device, total",
    [
        ({"train_micro_batch_size_per_gpu": 4}, 1, 4, 4),  # no accumulation: DeepSpeed's default
        ({"train_micro_batch_size_per_gpu": 4}, 8, 4, 32),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}, 2, 4, 64),
        ({"train_batch_size": 64, "gradient_accumulation_steps": 4}, 2, 8, 64),
        ({"train_batch_size": 64}, 4, 16, 64),
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 2, 4, 64),
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 4, 4, 64),
        ({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 16}, 2, 32, 1024),  # seed 004
        ({"gradient_accumulation_steps": 2}, 1, 32, 64),  # the micro batch is the flag's default
        ({"train_micro_batch_size_per_gpu": 4, "train_batch_size": "auto"}, 1, 4, 512),  # the total is the flag's
    ],
)  # fmt: skip
def test_the_batch_follows_deepspeeds_rule(ds: dict[str, Any], world_size: int, per_device: int, total: int) -> None:
    assert flags(ds, world_size=world_size) == ["--per-device-train-batch-size", str(per_device),
                                                "--total-batch-size", str(total)]  # fmt: skip


def test_a_batch_flag_beside_the_file_takes_the_place_of_its_key_and_the_accumulation_gives_way() -> None:
    seed = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 16}
    assert flags(seed, ["--per-device-train-batch-size", "2"], 4) == ["--total-batch-size", "128"]
    three = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 16}
    assert flags(three, ["--per-device-train-batch-size=8"]) == ["--total-batch-size", "64"]
    assert "gradient_accumulation_steps 16 gives way to the flags beside the file (8 here)" in warning(
        three, ["--per-device-train-batch-size=8"]
    )
    assert flags(three, ["--per-device-train-batch-size", "8", "--total-batch-size", "16"]) == []


@pytest.mark.parametrize(
    "ds, world_size, says",
    [
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 2,
         "train_batch_size 64 ≠ train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 4 × 2 ranks "
         "(WORLD_SIZE) = 32"),
        ({"train_batch_size": 60, "gradient_accumulation_steps": 8}, 1,
         "train_batch_size 60 is not a multiple of gradient_accumulation_steps 8 × 1 rank (WORLD_SIZE) = 8"),
        ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4}, 1,
         "train_batch_size 6 is not a multiple of train_micro_batch_size_per_gpu 4 × 1 rank (WORLD_SIZE) = 4"),
        ({"train_batch_size": 64}, 3, "train_batch_size 64 is not a multiple of gradient_accumulation_steps 1"),
        ({"train_micro_batch_size_per_gpu": 0}, 1, "train_micro_batch_size_per_gpu 0: give a whole number"),
        ({"train_batch_size": 1.5}, 1, "train_batch_size 1.5: give a whole number"),
    ],
)  # fmt: skip
def test_a_batch_that_does_not_add_up_names_the_keys_and_numbers(ds: dict[str, Any], world_size: int,
                                                                 says: str) -> None:  # fmt: skip
    assert says in refusal(ds, world_size=world_size)


def test_the_ranks_are_the_launchers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """WORLD_SIZE as torchrun (or the deepspeed launcher) sets it; 1 without one."""
    path = ds_file(tmp_path, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})
    assert parse([*BASE, "--deepspeed", str(path)]).total_batch_size == 4
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parse([*BASE, "--deepspeed", str(path)]).total_batch_size == 16


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "ds, says",
    [
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
         "zero_optimization.offload_optimizer without offload_param"),
        ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type Lamb: the inner optimizer here is "
                                                                  "AdamW"),
        ({"optimizer": {"type": "OneBitAdam"}}, "optimizer.type OneBitAdam"),
        ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "adam_w_mode false is Adam with L2"),
        ({"optimizer": {"type": "AdamW", "params": {"eps": 1e-6}}}, "optimizer.params.eps 1e-06: the inner AdamW here "
                                                                    "uses eps 1e-8"),
        ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, "amsgrad and bias_correction"),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type OneCycle: the schedule here is linear "
                                                            "warm-up, then cosine decay"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}},
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}, "warmup_max_lr 0.001 and optimizer.params.lr "
                                                                   "0.0003 differ"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage 4: give 0, 1, 2 or 3"),
        ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, "zero_optimization.offload_param.device 'gpu'"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
        ({"curriculum_learning": {"enabled": True}}, "curriculum_learning: batches are not reordered"),
        ({"gradient_clipping": "1.0"}, "gradient_clipping '1.0': give a number"),
        ({"zero_optimization": [2]}, "zero_optimization: give a JSON object {...}, not a list"),
    ],
)  # fmt: skip
def test_a_key_that_cannot_be_honoured_is_refused(ds: dict[str, Any], says: str) -> None:
    assert says in refusal(ds)


def test_a_refusal_is_one_line_naming_the_file_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = ds_file(tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    line = usage_error([*BASE, "--deepspeed", str(path)], capsys)
    assert line.startswith(f"error: --deepspeed {path}: zero_optimization.offload_optimizer without offload_param")
    assert 'set offload_param.device to "cpu" too, or drop offload_optimizer' in line
    sgd = ds_file(tmp_path, {"optimizer": {"type": "SGD"}}, "sgd.json")
    assert usage_error([*BASE, "--deepspeed", str(sgd)], capsys).startswith(f"error: --deepspeed {sgd}: "
                                                                            "optimizer.type SGD")  # fmt: skip


# ---------------------------------------------------------------- what has no meaning here: one warning line


def test_keys_without_a_meaning_here_are_named_together_in_one_warning_line() -> None:
    ds = json.loads(SEED004.read_text())
    line = warning(ds, ["--cpu-offload"])
    assert line is not None and "\n" not in line and line.startswith("ignored, no meaning here: ")
    for key in ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "zero_optimization.overlap_comm",
                "zero_optimization.contiguous_gradients", "zero_optimization.reduce_bucket_size",
                "zero_optimization.allgather_bucket_size", "zero_optimization.reduce_scatter",
                "zero_optimization.offload_optimizer.pin_memory"):  # fmt: skip
        assert key in line, key
    for mapped in ("gradient_clipping", "zero_optimization.stage", "bf16", "gradient_accumulation_steps"):
        assert mapped not in line, mapped
    nvme = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}},
            "steps_per_print": 10, "wall_clock_breakdown": False, "aio": {"block_size": 1048576}}  # fmt: skip
    assert flags(nvme) == ["--sharding-strategy", "FULL_SHARD"]
    assert warning(nvme) == ("ignored, no meaning here: zero_optimization.offload_param.nvme_path, "
                             "zero_optimization.offload_param.device nvme, steps_per_print, wall_clock_breakdown, aio")  # fmt: skip
    assert warning({"zero_optimization": {"stage": 1}}) is None


def test_a_schedule_of_another_shape_is_said_in_the_same_line() -> None:
    ds = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}},
          "tensorboard": {"enabled": True}}  # fmt: skip
    line = warning(ds)
    assert line is not None and "\n" not in line
    assert line.startswith("ignored, no meaning here: tensorboard; scheduler: WarmupDecayLR decays linearly to 0")
    assert "warmup_type log" in line and "cosine decay to 0 at --max-steps" in line
    cosine = {"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}}}
    assert warning(cosine) is None


def test_the_warning_is_printed_once_on_stderr_by_rank_0_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    path = ds_file(tmp_path, {"steps_per_print": 10, "zero_optimization": {"stage": 3, "overlap_comm": True}})
    parse([*BASE, "--deepspeed", str(path)])
    out = capsys.readouterr()
    assert out.err == (f"warning: --deepspeed {path}: ignored, no meaning here: steps_per_print, "
                       "zero_optimization.overlap_comm\n") and out.out == ""  # fmt: skip
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    parse([*BASE, "--deepspeed", str(path)])
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- the file and the flags themselves


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "no such file"),
        ("{\"zero_optimization\": {\"stage\": 2,}}", "not a JSON file (Expecting property name"),
        ("", "not a JSON file"),
        ("[1, 2]", "a DeepSpeed config is a JSON object {...}, not a list"),
        ("{\"bf16\": {\"enabled\": true}, \"bf16\": {\"enabled\": false}}", "not a JSON file (duplicate key 'bf16')"),
    ],
)  # fmt: skip
def test_a_bad_file_is_one_line_naming_deepspeed_and_exit_2(
    tmp_path: Path, content: str | None, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ds_config.json"
    if content is not None:
        path.write_text(content)
    line = usage_error([*BASE, "--deepspeed", str(path)], capsys)
    assert line.startswith(f"error: --deepspeed {path}: {says}") and "Traceback" not in line, line


def test_the_deepspeed_flag_needs_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "error: --deepspeed needs a DeepSpeed JSON config file" in usage_error([*BASE, "--deepspeed"], capsys)
    assert "error: --deepspeed needs a" in usage_error([*BASE, "--deepspeed="], capsys)


def test_deepspeeds_own_spelling_of_the_file_is_taken_too(tmp_path: Path) -> None:
    """DeepSpeed's scripts say `--deepspeed --deepspeed_config ds_config.json`."""
    path = ds_file(tmp_path, {"zero_optimization": {"stage": 1}})
    for argv in (["--deepspeed", "--deepspeed_config", str(path)], [f"--deepspeed_config={path}", "--deepspeed"],
                 ["--deepspeed-config", str(path)], [f"--deepspeed={path}"]):  # fmt: skip
        assert parse([*BASE, *argv]).sharding_strategy == "ZERO1", argv


@pytest.mark.parametrize("argv", [["--local_rank", "0"], ["--local_rank=3"], ["--local-rank", "1"], ["--local-rank=0"]])
def test_the_deepspeed_launchers_local_rank_is_accepted_and_ignored(argv: list[str]) -> None:
    assert parse([*argv, *BASE]) == parse(BASE)


def test_a_local_rank_without_a_number_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert "error: --local_rank needs a number" in usage_error([*BASE, "--local_rank"], capsys)


def test_diloco_train_takes_the_file_too(tmp_path: Path) -> None:
    seen: list[Config] = []
    path = ds_file(tmp_path, {"zero_optimization": {"stage": 0}})
    argv = ["train", *BASE, "--deepspeed", str(path), "--local_rank=0"]
    assert run_app(build_app(train_fn=lambda config: seen.append(config) or 0), argv) == 0
    assert seen[0].sharding_strategy == "DDP"


def test_diloco_launch_checks_the_batch_for_the_ranks_of_its_groups(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The launcher's own process is one rank; its groups have --nproc-per-worker each."""
    launched: list[Config] = []
    monkeypatch.setattr("diloco.launch.launch", lambda config, args, workers, nproc: launched.append(config) or 0)
    path = ds_file(tmp_path, {"train_batch_size": 8, "gradient_accumulation_steps": 2})
    model = ROOT / "tests" / "models" / "llama-1m-fresh"
    argv = ["launch", "--nproc-per-worker", "2", "--", "--path-model", str(model), "--fake-data", "--deepspeed",
            str(path)]  # fmt: skip
    assert run_app(build_app(), argv) == 0
    assert (launched[0].per_device_train_batch_size, launched[0].total_batch_size) == (2, 8)


# ---------------------------------------------------------------- the seeds' configs


def test_seed_004s_config_is_refused_for_its_optimizer_offload_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """ZeRO-2 with the optimizer state offloaded keeps the parameters on the GPU; FSDP offloads both."""
    line = usage_error([*BASE, "--deepspeed", str(SEED004)], capsys)
    assert "zero_optimization.offload_optimizer without offload_param" in line


def test_seed_configs_map_to_the_flags_a_user_would_write() -> None:
    seed004 = parse([*BASE, "--deepspeed", str(SEED004), "--cpu-offload"])
    assert (seed004.sharding_strategy, seed004.cpu_offload, seed004.precision) == ("SHARD_GRAD_OP", True, "bf16-mixed")
    assert (seed004.max_grad_norm, seed004.per_device_train_batch_size, seed004.total_batch_size) == (0.3, 32, 512)
    seed003 = parse([*BASE, "--deepspeed", str(SEED003)])
    assert (seed003.sharding_strategy, seed003.lr) == ("SHARD_GRAD_OP", 5e-5)
    assert (seed003.per_device_train_batch_size, seed003.total_batch_size) == (4, 4)


# the same short CPU run for both: float32 (the file's bf16 is overridden beside it, in both runs), 3 steps
RUN = ["--path-model", str(ROOT / "tests" / "models" / "llama-1m-fresh"), "--fake-data", "--no-torch-compile",
       "--precision", "32-true", "--max-steps", "3", "--seq-length", "32", "--warmup-steps", "1", "--eval-steps", "1"]  # fmt: skip
SAME_RUNS = {
    "seed004": (["--deepspeed", str(SEED004), "--per-device-train-batch-size", "2", "--no-cpu-offload"],
                ["--sharding-strategy", "SHARD_GRAD_OP", "--max-grad-norm", "0.3", "--per-device-train-batch-size", "2",
                 "--total-batch-size", "32"]),
    "seed003": (["--deepspeed", str(SEED003)],
                ["--sharding-strategy", "SHARD_GRAD_OP", "--per-device-train-batch-size", "4", "--total-batch-size",
                 "4", "--lr", "5e-5"]),
}  # fmt: skip


@pytest.fixture
def in_process_training(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A group of one trained in this process (gloo over a HashStore, no rendezvous): one torch thread (the machine's
    cores are shared), the signal handlers the trainer installs put back afterwards, and no stack dump on SIGUSR1
    (faulthandler writes to the real stderr, which pytest's capture replaces)."""
    import torch

    threads = torch.get_num_threads()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    torch.set_num_threads(1)
    monkeypatch.setattr(faulthandler, "register", lambda *args, **kwargs: None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    yield
    torch.set_num_threads(threads)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def train(argv: list[str], run_dir: Path) -> str:
    """`python -m diloco.train argv`, in process; the trained model's params_sha256."""
    assert run_app(build_app(train_only=True), [*RUN, *argv, "--run-dir", str(run_dir)]) == 0
    return json.loads((run_dir / "summary.json").read_text())["params_sha256"]


@pytest.mark.parametrize("seed", SAME_RUNS)
def test_a_seed_config_starts_the_same_training_as_the_flags_written_by_hand(
    seed: str, tmp_path: Path, in_process_training: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with_file, by_hand = SAME_RUNS[seed]
    assert parse([*RUN, *with_file]) == parse([*RUN, *by_hand]) != parse(RUN)
    assert train(with_file, tmp_path / "file") == train(by_hand, tmp_path / "hand")

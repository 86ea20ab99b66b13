"""Checks of a training run's input that need neither torch nor a process group.

The command line runs them before it imports torch and transformers (seconds of CPU per process), so bad input
fails in a fraction of a second, before anything is written; ``diloco.train.trainer.main`` runs them again (they are
cheap) and then the checks that need torch.
"""

from __future__ import annotations

from pathlib import Path

from diloco import checkpoint, hub
from diloco.config import Config
from diloco.errors import FieldError, UsageError
from diloco.outer.auto import galaxy_moment
from diloco.procs import check_tempdir


def ckpt_folder(config: Config, run_dir: Path | None) -> Path:
    """Where step-N checkpoints go: ``ckpt.path``, else ``<run dir>/checkpoints``."""
    return config.ckpt.path if config.ckpt.path is not None else run_dir / "checkpoints"


def check_run(config: Config, world_size: int) -> Path | None:
    """Named files exist, the batch divides over the ranks (and in two halves for the galaxy moment), the run
    folder is free (or resumed), and the checkpoint to resume from holds every file. Returns that checkpoint's
    folder, None when not resuming."""
    check_files(config)
    check_batch(config, world_size)
    if config.hv.galaxy_size > 1:
        check_tempdir()  # the swarm's processes need a short one
    if config.run_dir is not None and config.ckpt.resume is None and (config.run_dir / "metrics.jsonl").exists():
        raise FieldError(
            f"{{run_dir}} {config.run_dir} already holds a run (metrics.jsonl); pick another folder or continue it "
            "with {ckpt.resume}"
        )
    if config.ckpt.resume is None:
        return None
    if config.ckpt.resume != "latest":
        path = Path(config.ckpt.resume)
    elif config.ckpt.path is None and config.run_dir is None:
        raise FieldError("{ckpt.resume} latest needs {ckpt.path} (or {run_dir}) to say where to look")
    else:
        path = checkpoint.latest(ckpt_folder(config, config.run_dir))
    checkpoint.check_layout(path, world_size)
    return path


def check_files(config: Config) -> None:
    """Fail before any work starts when a named file or folder is missing, or a hub id is in no cache while
    the hub is off or unreachable (one connection attempt at most: see ``diloco.hub``)."""
    if hub.is_hub_id(str(config.path_model)):
        hub.check_name("path_model", str(config.path_model))
    elif not config.path_model.is_dir():
        raise UsageError(f"--path-model {config.path_model}: no such local folder, nor a Hugging Face hub id")
    elif not (config.path_model / "config.json").is_file():
        raise UsageError(f"--path-model {config.path_model}: no config.json in that folder")
    if config.dataset is not None and hub.is_hub_id(str(config.dataset)):
        hub.check_name("dataset", str(config.dataset), "dataset")
    elif config.dataset_config is not None:
        raise UsageError(f"--dataset-config {config.dataset_config}: --dataset {config.dataset} is a local path, not a "
                         "hub dataset with configurations")  # fmt: skip
    elif config.dataset is not None and not config.dataset.exists():
        raise UsageError(f"--dataset {config.dataset}: no such file or folder")
    if config.hv.swarm_key is not None:
        from diloco.swarm.records.swarm_key import SwarmKey  # plain Python

        try:
            SwarmKey.load(config.hv.swarm_key)
        except FieldError as e:
            raise e.within("hv") from None
    if config.tokenizer is not None and hub.is_hub_id(config.tokenizer):
        hub.check_name("tokenizer", config.tokenizer)
    elif config.tokenizer is not None and not Path(config.tokenizer).is_dir():
        raise UsageError(f"--tokenizer {config.tokenizer}: no such local tokenizer folder")


def check_batch(config: Config, world_size: int) -> int:
    """``Config.grad_accumulation``, and that the galaxy moment, where asked for, finds two halves in a step; returns
    the micro-batches per inner step."""
    grad_accum = config.grad_accumulation(world_size)
    galaxy_moment(config, config.total_batch_size * config.seq_length, grad_accum)
    return grad_accum

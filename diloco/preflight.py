"""Checks of a training run's input that need neither torch nor a process group.

The command line runs them before it imports torch and transformers (seconds of CPU per process), so bad input
fails in a fraction of a second, before anything is written; ``train.main`` runs them again (they are cheap) and
then the checks that need torch.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from diloco import checkpoint
from diloco.config import Config, FieldError, UsageError

# hivemind shares memory through torch's "file_system" strategy, whose manager listens on a unix socket inside the
# temp folder; a socket path holds at most 107 bytes, so a longer TMPDIR fails deep inside torch (measured limit
# with torch 2.13: 73 characters)
TEMPDIR_MAX_CHARS = 73


def ckpt_folder(config: Config, run_dir: Path | None) -> Path:
    """Where step-N checkpoints go: ``ckpt.path``, else ``<run dir>/checkpoints``."""
    return config.ckpt.path if config.ckpt.path is not None else run_dir / "checkpoints"


def check_run(config: Config, world_size: int) -> Path | None:
    """Named files exist, the batch divides over the ranks (and in two halves for the galaxy moment), the run
    folder is free (or resumed), and the checkpoint to resume from holds every file. Returns that checkpoint's
    folder, None when not resuming."""
    config.check_files()
    config.check_batch(world_size)
    if config.hv.galaxy_size > 1:
        check_tempdir()
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


def check_tempdir() -> None:
    """The temp folder's path is short enough for the socket of torch's shared-memory manager (the swarm needs
    it); a clear line naming TMPDIR instead of a traceback from torch's C++ side."""
    folder = tempfile.gettempdir()
    if len(folder) > TEMPDIR_MAX_CHARS:
        raise UsageError(
            f"TMPDIR {folder}: {len(folder)} characters; the swarm needs a temp folder path of at most "
            f"{TEMPDIR_MAX_CHARS} (torch's shared-memory socket lives there): set TMPDIR to a shorter folder"
        )

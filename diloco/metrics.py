"""Metrics: one logger for the run's rows (console, metrics.jsonl, TensorBoard, wandb), written by rank 0 only."""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from diloco.console import ProgressLine


class Sink(Protocol):
    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line, flushed at once so a killed run keeps every row it logged."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class WandbSink:
    """Weights & Biases; honours WANDB_MODE (offline works without a network)."""

    def __init__(self, project: str, name: str, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=project, name=name, dir=str(run_dir), config=config)

    def write(self, row: dict[str, Any]) -> None:
        self.run.log(row, step=row.get("step"))

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    """TensorBoard event files in ``<run dir>/tensorboard`` (``tensorboard --logdir runs/`` shows every group).

    Every numeric field of a row becomes a scalar at global step = the row's ``step``, its wall time the row's
    ``time``. Tags are namespaced by kind of row: ``eval/<field>`` for the ``eval_`` fields (``eval/loss``,
    ``eval/perplexity``), ``outer/<field>`` for every field of an outer-step row (``outer/num_peers``,
    ``outer/averaging_s``, ``outer/bytes_sent``, ...) and ``train/<field>`` otherwise (``train/loss``,
    ``train/lr``, ``train/tokens_per_s``, ``train/peak_memory_mb``). Strings (digests, the transport), None and
    booleans are not scalars and are left out. Flushed after every row, so a killed run keeps what it logged.
    """

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, row: dict[str, Any]) -> None:
        step, walltime = row.get("step"), row.get("time")
        for tag, value in scalar_tags(row).items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=walltime)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def scalar_tags(row: dict[str, Any]) -> dict[str, float]:
    """A row's numeric fields under their TensorBoard tags (the scheme in ``TensorBoardSink``)."""
    kind = "outer" if "outer_step" in row else "train"
    tags: dict[str, float] = {}
    for key, value in row.items():
        if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        tag = f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"{kind}/{key}"
        tags[tag] = float(value)
    return tags


class Metrics:
    """Fans rows out to the sinks; a no-op on every rank but 0."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    @classmethod
    def build(
        cls,
        *,
        enabled: bool,
        run_dir: Path,
        extra_sinks: Sequence[str],
        max_steps: int,
        project: str,
        run_name: str,
        config: dict[str, Any],
    ) -> Metrics:
        """metrics.jsonl and the console always; ``extra_sinks`` by name (``tensorboard``, ``wandb``), as
        ``Config.metric_sinks`` lists them, validated there. ``max_steps``: the console's step/max and ETA."""
        if not enabled:
            return cls([])
        sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl"), ProgressLine(max_steps)]
        if "tensorboard" in extra_sinks:
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        if "wandb" in extra_sinks:
            sinks.append(WandbSink(project, run_name, run_dir, config))
        return cls(sinks)

    def log(self, row: dict[str, Any]) -> None:
        """Every sink gets the row with ``time`` (unix seconds) added: plots against wall-clock read it."""
        row = {**row, "time": time.time()}
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory allocated by torch, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return host_peak_mb()


def host_peak_mb() -> float:
    """The process's peak resident set size so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def peak_reserved_mb(device: torch.device) -> float | None:
    """Peak accelerator memory reserved by torch's caching allocator (what the device really gave up); None on
    CPU, where there is no such pool."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    return None


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write-then-rename, so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)

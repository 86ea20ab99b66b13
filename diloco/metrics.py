"""Metrics: one logger for the run's rows (console, metrics.jsonl, wandb), written by rank 0 only."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any, Protocol

import torch


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


class ConsoleSink:
    """A short progress line per row on stdout."""

    def write(self, row: dict[str, Any]) -> None:
        parts = [f"{key} {_fmt(value)}" for key, value in row.items()]
        print(" | ".join(parts), file=sys.stdout, flush=True)

    def close(self) -> None:
        pass


class WandbSink:
    """Weights & Biases; honours WANDB_MODE (offline works without a network)."""

    def __init__(self, project: str, name: str, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=project, name=name, dir=str(run_dir), config=config)

    def write(self, row: dict[str, Any]) -> None:
        self.run.log(row, step=row.get("step"))

    def close(self) -> None:
        self.run.finish()


class Metrics:
    """Fans rows out to the sinks; a no-op on every rank but 0."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    @classmethod
    def build(
        cls, *, enabled: bool, run_dir: Path, logger_type: str, project: str, run_name: str, config: dict[str, Any]
    ) -> Metrics:
        if not enabled:
            return cls([])
        sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl"), ConsoleSink()]
        if logger_type == "wandb":
            sinks.append(WandbSink(project, run_name, run_dir, config))
        return cls(sinks)

    def log(self, row: dict[str, Any]) -> None:
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
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write-then-rename, so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)

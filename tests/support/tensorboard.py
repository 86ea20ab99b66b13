"""Metrics rows of every kind (train, eval, outer) logged through a TensorBoardSink, and the scalars TensorBoard
should show for them."""

from __future__ import annotations

import time
from pathlib import Path

from diloco.metrics import Metrics, TensorBoardSink

ROWS = [
    {"step": 1, "loss": 6.5, "lr": 0.0, "tokens_per_s": 1200.0, "peak_memory_mb": 310.5},
    {"step": 2, "loss": 5.25, "lr": 5e-3, "tokens_per_s": 1300.0, "peak_memory_mb": 311.0},
    {"step": 2, "eval_loss": 5.0, "eval_perplexity": 148.4},
    {"step": 2, "outer_step": 1, "outer_digest": "ab12", "num_peers": 2, "averaging_s": 0.75, "bytes_sent": 4096,
     "transport": "tcp", "loaded_state_from": None, "params_sha256": "cd34", "skipped": True},
]  # fmt: skip
TAGS = {
    "train/loss", "train/lr", "train/tokens_per_s", "train/peak_memory_mb", "eval/loss", "eval/perplexity",
    "outer/outer_step", "outer/num_peers", "outer/averaging_s", "outer/bytes_sent",
}  # fmt: skip


def log_rows(log_dir: Path) -> tuple[float, float]:
    """Log ROWS through a TensorBoardSink; the wall-clock span they were logged in."""
    metrics = Metrics([TensorBoardSink(log_dir)])
    before = time.time()
    for row in ROWS:
        metrics.log(row)
    after = time.time()
    metrics.close()
    return before, after

"""`diloco bench overhead`: inner-step tokens/s of a DiLoCo worker (DHT and averager running) against the same
model with galaxy size 1, alternating, and the peak RSS of both."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from diloco.bench.arms import Arm, Workload, markdown, pooled, run_arm, workload_dict

__all__ = ["markdown", "measure"]

OVERHEAD_TARGET = 0.98


def overhead_workload(quick: bool) -> tuple[Workload, int]:
    """The workload and the repetitions of each arm."""
    if quick:
        # one repetition: a smoke run
        return Workload("llama-2m-fresh", seq_length=32, per_device_batch=2, total_batch=2, steps=6, skip=2), 1
    return Workload("llama-14m-fresh", seq_length=128, per_device_batch=4, total_batch=4, steps=16, skip=4), 3


def overhead_arms(workload: Workload, run_id: str) -> list[Arm]:
    """Galaxy size 1 (no DHT) against a lone DiLoCo worker of a galaxy of 2: its DHT and averager run, it waits
    1 s at the rendezvous (before the first step), and H is past the last step, so no outer step is timed."""
    diloco = (
        "--hv.galaxy-size", "2", "--hv.pace", "fixed", "--hv.local-steps", str(workload.steps + 1),
        "--hv.averaging-timeout", "1", "--hv.matchmaking-time", "1", "--hv.run-id", run_id, "--hv.host-maddrs", "/ip4/127.0.0.1/tcp/0",
    )  # fmt: skip
    return [
        Arm("galaxy-1", (), 1, "plain training, no hivemind"),
        Arm("diloco-galaxy-2", diloco, 1, "DHT + averager running, no outer step inside the window"),
    ]


def measure(quick: bool, work_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Alternate the two arms (A B A B ...) `reps` times. Returns the result document, with per-arm medians
    over all measured steps of all repetitions and their ratio (DiLoCo ÷ alone)."""
    workload, reps = overhead_workload(quick)
    workload = workload.written(work_dir / "models")
    arms = overhead_arms(workload, f"bench-{os.getpid()}")
    runs = [run_arm(arm, workload, work_dir) for _ in range(reps) for arm in arms]
    summary = [pooled(arm, [r for r in runs if r.name == arm.name]) for arm in arms]
    ratio = summary[1]["tokens_per_s"] / summary[0]["tokens_per_s"]
    return {
        "workload": workload_dict(workload),
        "repetitions": reps,
        "arms": summary,
        "ratio": ratio,
        "target": OVERHEAD_TARGET,
        "runs": [asdict(r) for r in runs],
    }


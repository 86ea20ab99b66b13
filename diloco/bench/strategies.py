"""`diloco bench strategies`: NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, CPU offload and gradient checkpointing on
one model (2 ranks under torchrun, one worker group): tokens/s and peak memory per rank."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from diloco.bench.arms import Arm, Workload, markdown, run_arm, workload_dict

__all__ = ["markdown", "measure"]


def strategies_workload(quick: bool) -> Workload:
    if quick:
        return Workload("llama-2m-fresh", seq_length=32, per_device_batch=2, total_batch=4, steps=5, skip=2)
    return Workload("llama-14m-fresh", seq_length=128, per_device_batch=4, total_batch=8, steps=16, skip=4)


def strategy_arms(gpu: bool) -> list[Arm]:
    """The five arms, 2 ranks each; CPU offload says when it cannot change anything."""
    offload_note = "" if gpu else "no-op on CPU: parameters and optimizer state already live in CPU memory"
    return [
        Arm("NO_SHARD", ("--sharding-strategy", "NO_SHARD"), 2, "replicated (DDP-like)"),
        Arm("SHARD_GRAD_OP", ("--sharding-strategy", "SHARD_GRAD_OP"), 2, "ZeRO-2: params kept gathered fwd→bwd"),
        Arm("FULL_SHARD", ("--sharding-strategy", "FULL_SHARD"), 2, "ZeRO-3: reshard after forward"),
        Arm("FULL_SHARD+cpu-offload", ("--sharding-strategy", "FULL_SHARD", "--cpu-offload"), 2, offload_note),
        Arm(
            "FULL_SHARD+grad-ckpt",
            ("--sharding-strategy", "FULL_SHARD", "--gradient-checkpointing"),
            2,
            "activations recomputed in backward",
        ),
    ]


def measure(quick: bool, work_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Run every strategy arm once, one after the other. Returns the result document."""
    workload = strategies_workload(quick).written(work_dir / "models")
    arms = [run_arm(arm, workload, work_dir) for arm in strategy_arms(bool(info["gpus"]))]
    return {"workload": workload_dict(workload), "arms": [asdict(m) for m in arms]}

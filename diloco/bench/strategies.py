"""`diloco bench strategies`: torch DDP, DDP + ZeRO-1, the FSDP2 strategies, CPU offload and gradient checkpointing
on one model (2 ranks under torchrun, one worker group): tokens/s and peak memory per rank. Each arm names the
DeepSpeed ZeRO setting it corresponds to, for readers who know those."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from diloco.bench.arms import Arm, Workload, markdown, run_arm, workload_dict

__all__ = ["markdown", "measure"]


def strategies_workload(quick: bool, model: str | Path | None = None) -> Workload:
    """The quick or full workload; `model` (a `bench.models` name or a model folder) replaces its model."""
    if quick:
        workload = Workload("llama-2m-fresh", seq_length=32, per_device_batch=2, total_batch=4, steps=5, skip=2)
    else:
        workload = Workload("llama-14m-fresh", seq_length=128, per_device_batch=4, total_batch=8, steps=16, skip=4)
    return workload if model is None else replace(workload, model=model)


def strategy_arms(gpu: bool) -> list[Arm]:
    """The seven arms, 2 ranks each; CPU offload says when it cannot change anything."""
    offload_note = "" if gpu else "no-op on CPU: parameters and optimizer state already live in CPU memory"
    return [
        Arm("DDP", ("--sharding-strategy", "DDP"), 2, "torch DDP: full replica, gradients all-reduced", "stage 0"),
        Arm("ZERO1", ("--sharding-strategy", "ZERO1"), 2, "DDP, AdamW state split over ranks", "stage 1"),
        Arm("NO_SHARD", ("--sharding-strategy", "NO_SHARD"), 2, "FSDP2, replicated (DDP-like)", "stage 0"),
        Arm("SHARD_GRAD_OP", ("--sharding-strategy", "SHARD_GRAD_OP"), 2, "params kept gathered fwd→bwd", "stage 2"),
        Arm("FULL_SHARD", ("--sharding-strategy", "FULL_SHARD"), 2, "reshard after forward", "stage 3"),
        Arm(
            "FULL_SHARD+cpu-offload",
            ("--sharding-strategy", "FULL_SHARD", "--cpu-offload"),
            2,
            offload_note,
            "stage 3 + offload_param/offload_optimizer cpu",
        ),
        Arm(
            "FULL_SHARD+grad-ckpt",
            ("--sharding-strategy", "FULL_SHARD", "--gradient-checkpointing"),
            2,
            "activations recomputed in backward",
            "stage 3 + activation checkpointing",
        ),
    ]


# --quick is a smoke test of the bench itself (arms, report, table): three arms that differ most in how they run
# (ZeRO-1's optimizer, FSDP2, CPU offload) instead of seven two-rank jobs; that every strategy trains the same
# model is what the trainer's tests check
QUICK_ARMS = ("ZERO1", "FULL_SHARD", "FULL_SHARD+cpu-offload")


def measure(quick: bool, work_dir: Path, info: dict[str, Any], model: str | Path | None = None) -> dict[str, Any]:
    """Run every strategy arm (`QUICK_ARMS` with `quick`) once, one after the other. Returns the result document."""
    workload = strategies_workload(quick, model).written(work_dir / "models")
    chosen = [arm for arm in strategy_arms(bool(info["gpus"])) if not quick or arm.name in QUICK_ARMS]
    arms = [run_arm(arm, workload, work_dir) for arm in chosen]
    return {"workload": workload_dict(workload), "arms": [asdict(m) for m in arms]}

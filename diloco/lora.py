"""LoRA through peft (`--lora-r`): adapters on a frozen base, and the export of a LoRA run.

Only the adapters train, so only they are the group's outer state (``diloco.model.trainable_parameters``: what the
rounds average, the state downloads carry and the checkpoints hold). The base is what `--path-model` loads (or
initialises from `--seed`) in every group, so it needs no exchange. peft is imported only by a LoRA run.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from diloco.errors import FieldError, first_line

ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output head
MERGED = "merged"  # final/merged: the base with the adapters merged in (--lora-merge)


def add_adapters(model: PreTrainedModel, r: int, alpha: float | None, dropout: float, targets: list[str],
                 seed: int) -> torch.nn.Module:  # fmt: skip
    """`model` (frozen) inside a peft model with rank-`r` adapters on the `targets` modules, drawn from `seed`: every
    rank of every group starts from the same adapters. A target that matches no module is a `FieldError`."""
    from peft import LoraConfig, get_peft_model

    target: str | list[str] = ALL_LINEAR if targets == [ALL_LINEAR] else targets
    settings = LoraConfig(r=r, lora_dropout=dropout, target_modules=target,
                          **({} if alpha is None else {"lora_alpha": alpha}))  # fmt: skip
    torch.manual_seed(seed)
    try:
        return get_peft_model(model, settings)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise FieldError(f"{{lora_target_modules}} {' '.join(targets)}: {first_line(e)}") from None


def base_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The frozen base's floating-point parameters in `dtype`, the run's low precision: its forward computes in it
    anyway (FSDP casts every parameter to it, autocast every matrix multiply), and it holds half float32's memory on
    the accelerator. The adapters stay float32: they are what trains, averages and is saved."""
    with torch.no_grad():
        for param in model.parameters():
            if not param.requires_grad and param.is_floating_point():
                param.data = param.data.to(dtype)


def save(model: torch.nn.Module, state: dict[str, torch.Tensor], out_dir: Path, merge: bool) -> None:
    """Write the adapters of `model` (a peft model) from its full state dict `state` in peft's format to `out_dir`
    (`PeftModel.from_pretrained(base, out_dir)` loads them); with `merge` also `out_dir/merged`, a model folder of the
    base with the adapters merged in (`AutoModelForCausalLM.from_pretrained` loads it)."""
    from peft import get_peft_model
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(out_dir, state_dict=state)  # peft picks the adapters out of the whole state
    if merge:  # built on the meta device around the tensors of `state`, which the merge copies before it adds to
        with torch.device("meta"):  # them (safe_merge: `state` may be the live model's own tensors)
            fresh = get_peft_model(AutoModelForCausalLM.from_config(model.get_base_model().config, dtype=torch.float32),
                                   copy.deepcopy(model.peft_config["default"]))  # fmt: skip
        fresh.load_state_dict(state, assign=True)
        merged = fresh.merge_and_unload(safe_merge=True)
        merged.tie_weights()
        merged.save_pretrained(out_dir / MERGED)

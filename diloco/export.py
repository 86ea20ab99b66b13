"""``final/``: the model a run ends with, as a folder ``from_pretrained`` loads, and its ``params_sha256``.

A whole model is never gathered: each tensor is gathered in turn (``parallel.full_tensors``), hashed and written
to its place in the safetensors files (``diloco.weight_files``) by rank 0, then dropped, so the export costs one
tensor's memory beside the shards however large the model. What ``save_pretrained`` would write is kept: the same
names (a tied weight once), ``config.json`` with the architecture and dtype, the generation config.

Two cases still gather the whole model on rank 0 and go through the libraries' own writers: a LoRA run (peft picks
the adapters from the whole state and merges them into the base), and a model whose Hugging Face class converts its
weights on save (transformers' ``revert_weight_conversion``, e.g. experts fused in memory but saved one by one),
since the names and shapes it writes are then not the model's own.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from diloco import lora, parallel
from diloco.model import Sha256Stream, save_hf
from diloco.weight_files import MAX_FILE_BYTES, WeightFiles, plan


def write_final(model: torch.nn.Module, out_dir: Path, adapters: bool = False, merge: bool = False,
                max_file_bytes: int = MAX_FILE_BYTES) -> str | None:  # fmt: skip
    """Collective: write `out_dir` on rank 0 (with `adapters`, a LoRA run: the adapters in peft's format, and the
    merged model in ``out_dir/merged`` with `merge`); returns params_sha256 of the whole model on rank 0, None
    elsewhere."""
    main = parallel.is_rank0()
    plain = parallel.unwrap(model)
    names = parallel.saved_names(model)
    if adapters or not keeps_names(plain, names):
        state = parallel.full_state_dict(model)
        sha = parallel.sha_of(model, state)
        if main and adapters:
            lora.save(plain, state, out_dir, merge)
        elif main:
            save_hf(plain, state, out_dir)
        return sha
    tensors = plain.state_dict(keep_vars=True)
    entries = plan([(name, tensors[name].dtype, tuple(tensors[name].shape)) for name in names], max_file_bytes)
    del tensors
    hashed = {name for name, _ in plain.named_parameters()}
    digest, files = Sha256Stream(), WeightFiles(out_dir, entries) if main else None
    for name, tensor in parallel.full_tensors(model, names):
        if files is not None and tensor is not None:
            if name in hashed:  # (sorted names: the parameters come in params_sha256's order)
                digest.update(tensor)
            files.write(name, tensor)
    if files is None:
        return None
    files.finish()
    write_config(plain, out_dir, next((e.dtype for e in entries if e.dtype.is_floating_point), torch.float32))
    return digest.hexdigest()


def keeps_names(model: torch.nn.Module, names: list[str]) -> bool:
    """Whether ``save_pretrained`` would write `names` as they are (no weight conversion of the model's class)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers from before weight conversions: it writes the state dict as it is
        return True
    shapes = dict(model.state_dict(keep_vars=True))
    on_meta = {name: torch.empty(tuple(shapes[name].shape), dtype=shapes[name].dtype, device="meta") for name in names}
    try:
        reverted = revert_weight_conversion(model, on_meta)
    except Exception:  # noqa: BLE001 - a conversion that needs real values: let the library write it
        return False
    return isinstance(reverted, dict) and sorted(reverted) == names and all(
        tuple(reverted[name].shape) == tuple(on_meta[name].shape) for name in names
    )


def write_config(model: torch.nn.Module, out_dir: Path, dtype: torch.dtype) -> None:
    """config.json as ``save_pretrained`` writes it (the class as architecture, the weights' dtype), and the
    generation config of a model that generates."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(out_dir)
    if getattr(model, "can_generate", lambda: False)() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)

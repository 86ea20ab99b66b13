"""A LoRA run's frozen base in 4 or 8 bits through bitsandbytes (`--load-in-4bit`, `--load-in-8bit`: QLoRA).

The base is built on the meta device and given its values one tensor at a time, from its checkpoint's safetensors
files or from its fresh draw (``diloco.fresh``): each linear layer of the decoder blocks becomes a bitsandbytes layer
whose weight is quantized on the rank's device as it arrives, so no rank holds the base in float32 (a 7B base: 27 GB
of host memory) or on the device before quantization. Embeddings, norms and the output head are loaded as float32,
as in any run (a LoRA run then holds its whole frozen base in its low precision: ``lora.base_in``). Quantization is
deterministic, so every rank of every group holds the same base, and only the adapters train, average and are saved
(``diloco.lora``); the base is never sharded (DDP). bitsandbytes is imported only here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from diloco.errors import FieldError, first_line
from diloco.fresh import Fresh
from diloco.model import checkpoint_of, decoder_layers, load_model, refuse_misfits
from diloco.shards import retie, tied_aliases

QUANT_4BIT = "nf4"  # QLoRA's 4-bit data type (normal float), with its scales quantized again (double quantization)
OUTLIER_THRESHOLD = 6.0  # LLM.int8(): activation columns above it multiply in 16 bits (bitsandbytes' default)


def bitsandbytes(field: str):  # noqa: ANN201 (the module)
    """The bitsandbytes module, or a FieldError naming config `field` when it cannot be imported."""
    try:
        import bitsandbytes as bnb
    except Exception as e:  # noqa: BLE001 - ImportError, or a native library that fails to load
        raise FieldError(f"{{{field}}}: bitsandbytes could not be imported ({first_line(e)}): pip install "
                         "bitsandbytes") from None  # fmt: skip
    return bnb


def load_quantized(name: Path | str, seed: int, attn_implementation: str | None, bits: int,
                   compute_dtype: torch.dtype, device: torch.device) -> PreTrainedModel:  # fmt: skip
    """Model `name` (a folder or a hub id, as ``diloco.model.load_model`` finds it) on `device` with the linear layers
    of its decoder blocks in `bits` bits (4: NF4, multiplying in `compute_dtype`; 8: LLM.int8()), every parameter
    frozen. A fresh model (config only) is drawn from `seed` as in any run, then quantized."""
    bnb = bitsandbytes(f"load_in_{bits}bit")
    model = load_model(name, seed, attn_implementation, meta=True)
    checkpoint = checkpoint_of(name)
    if checkpoint is not None:
        refuse_misfits(name, checkpoint.misfits(model))
        names: set[str] = set(checkpoint.files)

        def value(key: str, like: torch.Tensor) -> torch.Tensor:
            return checkpoint.read(key, (), torch.float32 if like.is_floating_point() else like.dtype)
    else:
        fresh = Fresh(model, decoder_layers(model), seed)
        names = set(fresh.names)

        def value(key: str, like: torch.Tensor) -> torch.Tensor:
            return fresh.whole(key)

    linears = {name for name, module in quantizable(model)}
    make = quantized_4bit(bnb, compute_dtype) if bits == 4 else quantized_8bit(bnb)
    fill(model, names, value, linears, make, device)
    if checkpoint is None:
        torch.manual_seed(seed)  # what the run draws next (the adapters), as after any fresh draw
    model.requires_grad_(False)
    return model


def quantizable(model: PreTrainedModel) -> list[tuple[str, torch.nn.Module]]:
    """The linear layers of the decoder blocks, by qualified name: the attention and MLP projections, which hold
    nearly all of a large model's parameters (the embeddings and the head stay as they are). GPT-2's are
    transformers' ``Conv1D``, a linear layer with its weight transposed."""
    blocks = {id(block) for block in decoder_layers(model)}
    found = []
    for prefix, module in model.named_modules():
        if id(module) in blocks:
            found += [(f"{prefix}.{name}", sub) for name, sub in module.named_modules()
                      if isinstance(sub, (torch.nn.Linear, Conv1D))]  # fmt: skip
    return found


def fill(model: torch.nn.Module, names: set[str], value: Callable[[str, torch.Tensor], torch.Tensor],
         linears: set[str], make: Callable[..., torch.nn.Module], device: torch.device) -> None:
    """Give the meta-device `model` its values on `device`, one tensor at a time in state-dict order: the weight of
    each of `linears` replaces its layer by ``make(inputs, outputs, has_bias, weight, device)``; every other tensor
    of `names` is set as it is (``value(name, the model's own)`` gives it whole). Buffers it lacks keep the values
    the model computed."""
    aliases = tied_aliases(model)
    for key, like in model.state_dict(keep_vars=True).items():
        if key in aliases or key not in names:
            continue
        owner, _, leaf = key.rpartition(".")
        whole = value(key, like)
        module = model.get_submodule(owner)
        if owner in linears and leaf == "weight":
            if isinstance(module, Conv1D):  # (inputs, outputs): a linear layer's weight is (outputs, inputs)
                whole = whole.t().contiguous()
            outputs, inputs = whole.shape
            layer = make(inputs, outputs, module.bias is not None, whole, device)
            model.set_submodule(owner, scales_left_out(layer))
        elif leaf in module._parameters:
            module._parameters[leaf] = torch.nn.Parameter(whole.to(device), requires_grad=False)
        else:
            module._buffers[leaf] = whole.to(device)
        del whole
    retie(model, aliases)  # (the head is never quantized: a tie stays one float parameter)
    for module in model.modules():  # computed buffers (rotary frequencies) to the device too
        for leaf, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[leaf] = buffer.to(device)


def scales_left_out(layer: torch.nn.Module) -> torch.nn.Module:
    """`layer` (a bitsandbytes one) with a state dict of its weight and bias alone: bitsandbytes adds the scales of
    its quantization beside them, under names that are neither parameters nor buffers, which torch's distributed
    state dicts (the checkpoints) cannot place. The base they belong to is frozen: --path-model gives it back."""

    def drop(module: torch.nn.Module, state: dict, prefix: str, local_metadata: object) -> None:
        for key in [key for key in state if key.startswith(prefix) and key[len(prefix):] not in ("weight", "bias")]:
            del state[key]

    layer.register_state_dict_post_hook(drop)
    return layer


def quantized_4bit(bnb, compute_dtype: torch.dtype):  # noqa: ANN001, ANN201
    def make(inputs: int, outputs: int, bias: bool, weight: torch.Tensor, device: torch.device) -> torch.nn.Module:
        new = bnb.nn.Linear4bit(inputs, outputs, bias=bias, compute_dtype=compute_dtype, compress_statistics=True,
                                quant_type=QUANT_4BIT, device="meta")  # fmt: skip
        # quantized on its way to the device (`Params4bit.to`); the module is told where its scales are
        new.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type=QUANT_4BIT,
                                       module=new).to(device)  # fmt: skip
        return new

    return make


def quantized_8bit(bnb):  # noqa: ANN001, ANN201
    def make(inputs: int, outputs: int, bias: bool, weight: torch.Tensor, device: torch.device) -> torch.nn.Module:
        new = bnb.nn.Linear8bitLt(inputs, outputs, bias=bias, has_fp16_weights=False, threshold=OUTLIER_THRESHOLD,
                                  device="meta")  # fmt: skip
        new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False).to(device)
        return new

    return make


def parameter_count(model: torch.nn.Module) -> int:
    """The model's parameters, a quantized weight counted by its values (4-bit weights pack two in a byte)."""
    return sum(quantized_shape(p).numel() for p in model.parameters())


def quantized_shape(param: torch.nn.Parameter) -> torch.Size:
    """A parameter's shape as a float tensor (a 4-bit weight's packed storage is of another shape)."""
    state = getattr(param, "quant_state", None)
    return torch.Size(state.shape) if state is not None else param.shape

"""Each rank's shards of a checkpoint read straight from its safetensors files, so that a group of several FSDP ranks
loads a model of any size with no rank ever holding the whole of it.

Every rank builds the model with its parameters on the meta device (``diloco.model.load_model(meta=True)``), shards
it, then reads from the files only the rows its shards hold, one tensor at a time, and the sharded tensors become the
parameters (``assign``: ``load_state_dict(assign=True)``, which FSDP2 follows). ``assign`` also serves the ranks of a
group that take rank 0's model (``diloco.parallel``). No broadcast: every rank reads the same files, so
the model is the one ``from_pretrained`` gives, bit for bit, whatever the number of ranks.

Used for the checkpoints whose tensor names are the model's own (what ``save_pretrained`` writes, ``final/`` among
them); a checkpoint that needs transformers' renaming goes through rank 0's ``from_pretrained`` instead.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

# (private: the very rule FSDP2 and torch's state-dict loaders use to place a rank's part of a tensor)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


@dataclass(frozen=True)
class Checkpoint:
    """A folder's safetensors weights: which file holds each tensor, and its shape."""

    files: dict[str, Path]
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def find(cls, folder: Path) -> Checkpoint | None:
        """The weights ``from_pretrained`` would read from `folder` (the index's files, else ``model.safetensors``);
        None when it has neither."""
        if (folder / INDEX).is_file():
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
            paths = sorted({folder / name for name in weight_map.values()})
        elif (folder / SINGLE).is_file():
            paths = [folder / SINGLE]
        else:
            return None
        files, shapes = {}, {}
        for path in paths:
            with safe_open(path, "pt") as f:  # the header alone: tensors are read later, a slice at a time
                for name in f.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                    files[name], shapes[name] = path, tuple(f.get_slice(name).get_shape())
        return cls(files, shapes)

    def misfits(self, model: torch.nn.Module) -> list[str]:
        """The model's parameters and persistent buffers the files lack or hold in another shape (a tied weight
        counts once, under its first name)."""
        return [name for name, shape in expected(model).items() if self.shapes.get(name) != shape]

    def load_into(self, model: torch.nn.Module, device: torch.device) -> None:
        """Give the sharded, meta-device `model` its values: each parameter's local shard, as float32 on `device`;
        persistent buffers whole, in their own dtype (those the files lack keep the value the model computed)."""

        def local_part(name: str, value: torch.Tensor) -> torch.Tensor:
            sharded = isinstance(value, DTensor)
            return self.read(name, local_index(value) if sharded else (), torch.float32 if sharded else value.dtype)

        assign(model, local_part, device, names=self.files.keys())

    def read(self, name: str, index: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        """`index` of tensor `name` as `dtype`, copied out of its file. The file is mapped for this one read (its
        pages count in this process's resident memory only while it is), and what safetensors returns is a view of
        the mapping: hence the copy."""
        with safe_open(self.files[name], "pt") as f:
            part = f.get_slice(name)[index] if index else f.get_tensor(name)
            return part.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def assign(model: torch.nn.Module, local_part: Callable[[str, torch.Tensor], torch.Tensor], device: torch.device,
           names: Collection[str] | None = None) -> None:  # fmt: skip
    """Give the sharded, meta-device `model` its values, one tensor at a time in state-dict order (the same on every
    rank): ``local_part(name, value)`` is this rank's part of tensor `name` (`value`: the model's own, a DTensor for a
    sharded parameter), which becomes the parameter or buffer (``load_state_dict(assign=True)``, which FSDP2
    follows). A tied weight is given once, under its first name; with `names`, only the tensors it holds."""
    aliases = tied_aliases(model)
    state = {}
    for name, value in model.state_dict().items():
        if name in aliases or (names is not None and name not in names):
            continue
        local = local_part(name, value).to(device)
        if isinstance(value, DTensor):
            local = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                       stride=value.stride())  # fmt: skip
        state[name] = local
    model.load_state_dict(state, strict=False, assign=True)
    retie(model, aliases)  # assign gave the first name a new parameter


def retie(model: torch.nn.Module, aliases: dict[str, str]) -> None:
    """Each later name of a tied weight (``tied_aliases``, taken before its first name got a new parameter) is that
    parameter again: one tensor, as the model was built."""
    for alias, name in aliases.items():
        owner, _, leaf = alias.rpartition(".")
        source, _, source_leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, getattr(model.get_submodule(source), source_leaf))


def local_index(value: DTensor) -> tuple[slice, ...]:
    """The part of the whole tensor that this rank's shard of `value` holds."""
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return tuple(slice(start, start + size) for size, start in zip(shape, offset))


def parameters_to_meta(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict, after which its parameters are swapped for meta-device ones (a tied one stays one),
    so the state dict holds the only reference to each: a whole tensor is freed as soon as it is dropped from it.
    Buffers stay as they are."""
    state = model.state_dict()
    on_meta: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):  # noqa: SLF001 (what register_parameter fills)
            if param is not None:
                if id(param) not in on_meta:
                    on_meta[id(param)] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                module._parameters[name] = on_meta[id(param)]  # noqa: SLF001
    return state


def expected(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> global shape of what a checkpoint must hold for `model`: its parameters (a tied one once) and
    persistent buffers."""
    aliases = tied_aliases(model)
    return {name: tuple(value.shape) for name, value in model.state_dict().items() if name not in aliases}


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Every later name of a parameter that has several (a tied embedding's ``lm_head.weight``) -> its first."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names[id(parameter)].append(name)
    return {alias: same[0] for same in names.values() for alias in same[1:]}

"""Each rank's shards of a checkpoint read straight from its safetensors files, so that a group of several FSDP ranks
loads a model of any size with no rank ever holding the whole of it.

Every rank builds the model with its parameters on the meta device (``diloco.model.load_model(meta=True)``), shards
it, then reads from the files only the rows its shards hold, one tensor at a time, and the sharded tensors become the
parameters (``load_state_dict(assign=True)``, which FSDP2 follows). No broadcast: every rank reads the same files, so
the model is the one ``from_pretrained`` gives, bit for bit, whatever the number of ranks.

Used for the checkpoints whose tensor names are the model's own (what ``save_pretrained`` writes, ``final/`` among
them); a checkpoint that needs transformers' renaming goes through rank 0's ``from_pretrained`` instead.
"""

from __future__ import annotations

import json
from collections import defaultdict
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
        aliases = tied_aliases(model)
        state = {}
        for name, value in model.state_dict().items():
            if name in aliases or name not in self.files:
                continue
            if isinstance(value, DTensor):
                shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
                rows = tuple(slice(start, start + size) for size, start in zip(shape, offset))
                local = self.read(name, rows, torch.float32).to(device)
                state[name] = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                                 shape=value.shape, stride=value.stride())  # fmt: skip
            else:
                state[name] = self.read(name, (), value.dtype).to(device)
        model.load_state_dict(state, strict=False, assign=True)
        for alias, name in aliases.items():  # the tie again: assign gave the first name a new parameter
            owner, _, leaf = alias.rpartition(".")
            source, _, source_leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, getattr(model.get_submodule(source), source_leaf))

    def read(self, name: str, index: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        """`index` of tensor `name` as `dtype`, copied out of its file. The file is mapped for this one read (its
        pages count in this process's resident memory only while it is), and what safetensors returns is a view of
        the mapping: hence the copy."""
        with safe_open(self.files[name], "pt") as f:
            part = f.get_slice(name)[index] if index else f.get_tensor(name)
            return part.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


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

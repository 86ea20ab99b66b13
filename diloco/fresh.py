"""A fresh model's initial values, drawn one unit at a time, so that a rank of any group holds at most one unit beside
its own shards, and every group shape starts from the same model.

A unit is a decoder block (``diloco.model.decoder_layers``) or, outside the blocks, one module's own parameters (the
token embedding, the final norm, the head). Each unit is drawn on a scratch copy of its own, by the architecture's
``_init_weights`` (what transformers runs on the weights a checkpoint lacks, so every parameter it knows is covered),
from a generator seeded by the run's seed and the unit's name alone. A rank keeps the rows its shards hold and drops
the rest. The values are therefore the same whatever the number of ranks, the sharding, or the order the units are
drawn in; they follow the architecture's distributions, but they are not ``from_config``'s (which draws the whole
model from one generator, so that a block's values depend on every draw before it).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from diloco.errors import UsageError
from diloco.shards import assign, local_index, tied_aliases


@dataclass(frozen=True)
class Unit:
    """What is drawn at once: `template`, a meta-device copy of the module; `whole`: its subtree too (a decoder
    block), or only its own parameters; `init`: the ``_init_weights`` of the nearest Hugging Face model above it."""

    template: torch.nn.Module
    whole: bool
    init: object


class Fresh:
    """The fresh initial values of `model` (built on the meta device, not yet sharded: ``load_model(meta=True)``) with
    decoder blocks `blocks`, drawn from `seed`. ``load_into`` gives a sharded or whole meta-device model its values."""

    def __init__(self, model: torch.nn.Module, blocks: list[torch.nn.Module], seed: int) -> None:
        self.seed = seed
        self.model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        aliases = tied_aliases(model)
        block_ids = {id(block) for block in blocks}
        self.unit_of: dict[str, str] = {}  # parameter name (a tied one under its first name) -> its unit's name
        self.units: dict[str, Unit] = {}
        self.names: list[str] = []
        for prefix, module, init, in_block in walk(model, block_ids):
            whole = id(module) in block_ids
            own = module.named_parameters(prefix=prefix, recurse=whole)
            names = [name for name, _ in own if name not in aliases]
            if names and (whole or not in_block):
                self.units[prefix] = Unit(copy.deepcopy(module), whole, init)
                self.unit_of.update({name: prefix for name in names})
                self.names += names
        self._drawn: tuple[str, dict[str, torch.Tensor]] = ("", {})

    def load_into(self, model: torch.nn.Module, device: torch.device) -> None:
        """Give the meta-device `model` (sharded or whole) its values on `device`: each parameter's local shard, as
        ``Checkpoint.load_into`` does; buffers keep the values the model computed. The global generator is left
        seeded by `seed`, as after ``torch.manual_seed``, so what the run draws next is the same for every shape."""

        def local_part(name: str, value: torch.Tensor) -> torch.Tensor:
            whole = self.whole(name)
            return whole[local_index(value)].clone() if isinstance(value, DTensor) else whole

        assign(model, local_part, device, names=set(self.names))
        self._drawn = ("", {})
        torch.manual_seed(self.seed)

    def whole(self, name: str) -> torch.Tensor:
        """Parameter `name`'s whole initial value. Its unit is drawn when it is not the one drawn last; each value is
        handed out once (a second call draws the unit again), so the unit's memory goes as its values do."""
        unit = self.unit_of[name]
        if self._drawn[0] != unit or name not in self._drawn[1]:
            self._drawn = (unit, {})  # (the last unit's values go first)
            self._drawn = (unit, self.draw(unit))
        return self._drawn[1].pop(name)

    def draw(self, unit: str) -> dict[str, torch.Tensor]:
        """Every parameter of `unit`, by full name, drawn on a scratch copy from the unit's own generator."""
        spec = self.units[unit]
        scratch = copy.deepcopy(spec.template)
        scratch.to_empty(device="cpu", recurse=spec.whole)
        params = list(scratch.named_parameters(prefix=unit, recurse=spec.whole))
        with torch.no_grad():
            for _, param in params:  # unset: what no init writes stays NaN and is caught below
                param.fill_(float("nan") if param.is_floating_point() else 0)
        for item in [scratch, *scratch.modules(), *(param for _, param in params)]:  # the copy is not "loaded"
            if hasattr(item, "_is_hf_initialized"):
                delattr(item, "_is_hf_initialized")
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(unit_seed(self.seed, unit))
            for module in post_order(scratch) if spec.whole else [scratch]:
                spec.init(module)
        unset = next((name for name, param in params if param.is_floating_point() and param.isnan().any()), None)
        if unset is not None:
            raise UsageError(
                f"model type {self.model_type!r}: its _init_weights leaves {unset} unset, so a fresh model cannot be "
                f"drawn for it (start from a checkpoint with weights instead)"
            )
        return {name: param.detach() for name, param in params}


def walk(model: torch.nn.Module, block_ids: set[int]):  # noqa: ANN201 (a generator of 4-tuples)
    """(qualified name, module, the init function of the nearest Hugging Face model at or above it, whether it is in
    or is a block's subtree below the block itself) for every module, parents first."""

    def visit(prefix: str, module: torch.nn.Module, init: object, in_block: bool):  # noqa: ANN202
        init = module._init_weights if isinstance(module, PreTrainedModel) else init
        yield prefix, module, init, in_block
        for name, child in module.named_children():
            yield from visit(f"{prefix}.{name}" if prefix else name, child, init, in_block or id(module) in block_ids)

    yield from visit("", model, None, False)


def post_order(module: torch.nn.Module) -> list[torch.nn.Module]:
    """`module`'s subtree, children before their parent, as ``nn.Module.apply`` and transformers' init visit it (a
    parent's init may redraw a child's weights: GPT-2 scales its residual projections that way)."""
    order = []
    for child in module.children():
        order += post_order(child)
    return [*order, module]


def unit_seed(seed: int, unit: str) -> int:
    """The generator seed of `unit` under the run's `seed`: from both alone."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{unit}".encode()).digest()[:8], "little") >> 1

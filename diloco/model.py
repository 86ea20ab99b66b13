"""Hugging Face causal LMs from a local folder or a hub id (through the cache): fresh initialisation or weights,
and export."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from diloco import hub
from diloco.errors import FieldError, UsageError, first_line
from diloco.fresh import Fresh
from diloco.shards import Checkpoint

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def has_weights(path: Path) -> bool:
    return any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS)


def load_model(name: Path | str, seed: int, attn_implementation: str | None = None,
               meta: bool = False) -> PreTrainedModel:  # fmt: skip
    """Load weights when the folder has them; with only config.json, initialise from `seed`. A hub id is its
    snapshot folder in the Hugging Face cache, under the same rule. `attn_implementation`: the attention kernel
    (transformers' name; None: its default for the model). `meta`: the model's structure, its parameters on the
    meta device (no memory, no weights read, the generator untouched) and its buffers computed, for a rank that
    receives its values from another or reads its shards alone (``diloco.parallel.parallelize``).

    A fresh model is drawn a unit at a time (``diloco.fresh``): the same values whatever the group's shape. Master
    weights are float32 whatever the folder holds: mixed precision is FSDP's job.
    """
    path = hub.local_folder("path_model", str(name), hub.MODEL_FILES)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise FieldError(f"{{path_model}} {name}: not a readable Hugging Face model config ({first_line(e)})") from None
    attention = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    weights = has_weights(path) and not meta
    try:
        if meta:
            with parameters_on_meta():
                return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attention)
        if weights:
            with quiet_transformers():  # its load report is a table; `check_fit` says what matters in one line
                model, info = AutoModelForCausalLM.from_pretrained(
                    path, dtype=torch.float32, local_files_only=True, output_loading_info=True,
                    ignore_mismatched_sizes=True, **attention,
                )  # fmt: skip
            check_fit(name, info)
            return model
        with parameters_on_meta():  # drawn a unit at a time, as the ranks of a sharded group draw it
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attention)
        Fresh(model, decoder_layers(model), seed).load_into(model, torch.device("cpu"))
        return model
    except (FieldError, UsageError):
        raise
    except Exception as e:  # safetensors, torch and transformers each raise their own types
        if attn_implementation is not None and attn_implementation in str(e):  # an unknown or unusable kernel
            raise FieldError(f"{{attn_implementation}} {attn_implementation}: {first_line(e)}") from None
        what = "could not load the weights" if weights else "could not build the model from its config.json"
        raise FieldError(f"{{path_model}} {name}: {what} ({first_line(e)})") from None


def checkpoint_of(name: Path | str) -> Checkpoint | None:
    """The safetensors weights of model `name` (a folder or a hub id, as ``load_model`` finds it), when its folder
    holds them by the names ``save_pretrained`` writes; None otherwise."""
    path = hub.local_folder("path_model", str(name), hub.MODEL_FILES)
    try:
        return Checkpoint.find(path)
    except Exception as e:  # safetensors raises its own type for a damaged header
        raise FieldError(f"{{path_model}} {name}: could not load the weights ({first_line(e)})") from None


def is_fresh(name: Path | str) -> bool:
    """Whether model `name` (a folder or a hub id, as ``load_model`` finds it) has no weights: a fresh model."""
    return not has_weights(hub.local_folder("path_model", str(name), hub.MODEL_FILES))


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters created in the block go to the meta device as they are registered, so no memory holds them and
    the initialisation that follows touches nothing; buffers stay real (rotary frequencies are computed, never
    loaded). The random generator is left as it was. (``Module.register_parameter`` is patched for the block: the
    model is built before the process starts any thread that could build modules meanwhile.)"""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.nn.Module.register_parameter = register


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings and progress bars off for the block (its errors still come as exceptions)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def check_fit(name: Path | str, info: dict[str, list]) -> None:
    """Refuse weights that leave parameters of config.json without a value or of another shape: transformers would
    initialise those at random with a warning, and a run would train from a half-loaded checkpoint."""
    missing = list(info.get("missing_keys") or []) + [str(m[0]) for m in info.get("mismatched_keys") or []]
    refuse_misfits(name, missing)


def refuse_misfits(name: Path | str, missing: list[str]) -> None:
    """A FieldError naming `name` when some parameters of its config.json have no value of their shape."""
    if missing:
        raise FieldError(
            f"{{path_model}} {name}: the weights do not fit its config.json: {len(missing)} parameter(s) missing or "
            f"of another shape (first: {missing[0]})"
        )


def decoder_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The repeated transformer blocks in model order, the unit FSDP shards, torch.compile compiles and gradient
    checkpointing recomputes: the modules whose class the model names in `_no_split_modules` (transformers' list
    of the blocks a device map never splits, e.g. GPT-2's ``GPT2Block``), outermost only; failing that, the
    ModuleList of `num_hidden_layers` modules."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = named_blocks(model, names) if names else []
    if blocks:
        return blocks
    depth = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == depth:
            return list(module)
    raise UsageError(
        f"model type {model.config.model_type!r}: could not find its decoder layers (no module of a class its "
        f"_no_split_modules names, no ModuleList of its {depth} hidden layers)"
    )


def named_blocks(module: torch.nn.Module, names: set[str]) -> list[torch.nn.Module]:
    """The submodules of `module` whose class name is in `names`, in model order, not looking inside a match."""
    found = []
    for child in module.children():
        found += [child] if type(child).__name__ in names else named_blocks(child, names)
    return found


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the inner optimizer steps, in model order: every one, or with LoRA (``diloco.lora``) the
    adapters alone. They are the group's outer state: what the rounds average and the state downloads carry."""
    return [p for p in model.parameters() if p.requires_grad]


def parameter_layers(model: PreTrainedModel) -> list[int | None]:
    """For each trainable parameter in model order, the decoder layer it belongs to (None: embeddings, final norm,
    head): what ``diloco.outer.fragments`` cuts fragments from."""
    home = {id(p): i for i, layer in enumerate(decoder_layers(model)) for p in layer.parameters()}
    return [home.get(id(p)) for p in trainable_parameters(model)]


def params_sha256(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over full parameters in name order, as float32 bytes: equal hashes mean equal models."""
    digest = Sha256Stream()
    for _, tensor in sorted(named_tensors, key=lambda item: item[0]):
        digest.update(tensor)
    return digest.hexdigest()


class Sha256Stream:
    """`params_sha256` fed one whole parameter at a time, in name order (``parallel.params_sha``)."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()

    def update(self, tensor: torch.Tensor | None) -> None:
        """Hash `tensor`'s float32 bytes (its own memory when it is float32 already); None: nothing (a rank that
        holds no whole tensors)."""
        if tensor is not None:
            self._digest.update(tensor.detach().to(torch.float32).contiguous().cpu().reshape(-1).numpy())

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def save_hf(model: PreTrainedModel, state_dict: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Write a folder that `AutoModelForCausalLM.from_pretrained(out_dir)` loads. The model written is built on the
    meta device around the tensors of `state_dict` (no second copy of the model in memory)."""
    from transformers.utils import logging as hf_logging

    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    fresh.load_state_dict(state_dict, assign=True)
    fresh.tie_weights()  # (assign gave a tied weight's names two parameters over one tensor: one parameter again)
    hf_logging.disable_progress_bar()  # a progress bar per tiny shard only clutters the run's log
    fresh.save_pretrained(out_dir)

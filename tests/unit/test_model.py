"""Model folders in and out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from diloco.errors import UsageError
from diloco.model import decoder_layers, load_model, params_sha256, save_hf
from tests.support.architectures import ARCHITECTURES
from tests.support.paths import ROOT, TINY_MODEL


def sha(model: torch.nn.Module) -> str:
    return params_sha256(list(model.named_parameters()))


def test_shipped_configs_match_their_description() -> None:
    tiny = load_model(TINY_MODEL, seed=0).config
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.num_attention_heads) == (64, 2, 2)
    assert (tiny.intermediate_size, tiny.vocab_size) == (256, 1024)
    big = load_model(ROOT / "tests" / "models" / "llama-14m-fresh", seed=0)
    assert 12e6 < sum(p.numel() for p in big.parameters()) < 16e6


def test_fresh_init_is_deterministic_by_seed() -> None:
    assert sha(load_model(TINY_MODEL, seed=1)) == sha(load_model(TINY_MODEL, seed=1))
    assert sha(load_model(TINY_MODEL, seed=1)) != sha(load_model(TINY_MODEL, seed=2))


def test_export_round_trip_and_weights_are_loaded(tmp_path: Path) -> None:
    model = load_model(TINY_MODEL, seed=3)
    save_hf(model, model.state_dict(), tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert sha(reloaded) == sha(model)
    # a folder with weights is loaded, not re-initialised, whatever the seed
    assert sha(load_model(tmp_path / "out", seed=99)) == sha(model)


def test_decoder_layers_are_the_repeated_blocks() -> None:
    model = load_model(TINY_MODEL, seed=0)
    layers = decoder_layers(model)
    assert len(layers) == 2 and all(type(layer).__name__ == "LlamaDecoderLayer" for layer in layers)


def test_decoder_layers_are_the_blocks_no_split_modules_names() -> None:
    """GPT-2 names its block class in `_no_split_modules`; its blocks are found by that name, in model order, not by
    the length of the list that holds them (a config claiming another depth finds the same blocks)."""
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **ARCHITECTURES["gpt2"]))
    assert "GPT2Block" in model._no_split_modules
    model.config.n_layer = 3  # num_hidden_layers, under GPT-2's name: no ModuleList is that long
    layers = decoder_layers(model)
    assert [type(layer).__name__ for layer in layers] == ["GPT2Block", "GPT2Block"]
    assert all(a is b for a, b in zip(layers, model.transformer.h, strict=True))


def test_without_no_split_modules_the_layer_list_is_found_and_without_either_one_line_refuses() -> None:
    model = load_model(TINY_MODEL, seed=0)
    model._no_split_modules = set()  # a model class that names no block: the ModuleList of num_hidden_layers
    assert all(a is b for a, b in zip(decoder_layers(model), model.model.layers, strict=True))
    model.model.layers = torch.nn.ModuleList(model.model.layers[:1])  # one layer of 2: no list of the depth either
    with pytest.raises(UsageError, match="model type 'llama': could not find its decoder layers") as raised:
        decoder_layers(model)
    assert "\n" not in str(raised.value)


def test_params_sha256_sees_one_changed_bit() -> None:
    model = load_model(TINY_MODEL, seed=0)
    before = sha(model)
    with torch.no_grad():
        weight = next(model.parameters())
        weight.view(-1)[0] = torch.nextafter(weight.view(-1)[0], torch.tensor(1.0))
    assert sha(model) != before


def test_corrupt_weights_are_a_usage_error(tmp_path: Path) -> None:
    shutil.copy(TINY_MODEL / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UsageError, match="could not load the weights"):
        load_model(tmp_path, seed=0)


def test_on_the_meta_device_the_weights_are_not_read(tmp_path: Path) -> None:
    """What every rank of a group but rank 0 builds (it takes rank 0's values as the model is sharded): the same
    parameters, holding no memory, from the config alone (corrupt weights beside it go unread)."""
    shutil.copy(TINY_MODEL / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    meta = load_model(tmp_path, seed=0, meta=True)
    real = load_model(TINY_MODEL, seed=0)
    assert all(p.is_meta for p in meta.parameters())
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]


@pytest.mark.parametrize(("key", "value"), [("num_hidden_layers", 3), ("intermediate_size", 128)])
def test_weights_that_do_not_fit_the_config_are_a_usage_error(tmp_path: Path, key: str, value: int) -> None:
    """A config.json with a layer more than the weights (transformers would initialise it at random), or with
    another width (shapes that do not fit): one line naming the flag and the folder, nothing loaded."""
    model = load_model(TINY_MODEL, seed=3)
    save_hf(model, model.state_dict(), tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    (tmp_path / "out" / "config.json").write_text(json.dumps(config | {key: value}))
    with pytest.raises(UsageError, match=r"path_model.*out.*(do not fit|could not load)") as raised:
        load_model(tmp_path / "out", seed=0)
    assert "\n" not in str(raised.value)

"""A fresh model drawn a unit at a time (``diloco.fresh``): every parameter the architecture has is drawn from its own
distribution, and a value depends on the seed and its unit alone, not on the order or the company it is drawn in
(what makes a group of any number of ranks start from the same model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from diloco.errors import UsageError
from diloco.fresh import Fresh
from diloco.model import decoder_layers, load_model
from tests.support.architectures import ARCHITECTURES, write_config


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_every_parameter_is_drawn_as_from_config_draws_it(model_type: str, tmp_path: Path) -> None:
    """Same distributions as transformers' own initialisation: constants (norms, biases, a padding row) equal, and
    each drawn tensor's spread within sampling error of ``from_config``'s; ties kept."""
    folder = write_config(model_type, tmp_path)
    model = load_model(folder, seed=0)
    torch.manual_seed(0)
    reference = dict(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).named_parameters())
    for name, param in model.named_parameters():
        expected = reference[name]
        assert not param.isnan().any(), name
        if expected.numel() == 1 or expected.std() == 0:
            assert torch.equal(param, expected), name
        else:
            spread = float(param.detach().std() / expected.detach().std())
            assert abs(spread - 1) < 0.1 + 3 / expected.numel() ** 0.5, name
            assert not torch.equal(param, expected), name  # drawn, and not by from_config's generator
    pad = model.config.pad_token_id
    if pad is not None:
        assert torch.count_nonzero(model.get_input_embeddings().weight[pad]) == 0
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == bool(model.config.tie_word_embeddings)


def meta_model(folder: Path) -> torch.nn.Module:
    return load_model(folder, seed=0, meta=True)


def test_a_value_depends_on_the_seed_and_its_unit_alone(tmp_path: Path) -> None:
    """Drawn in reverse order, each parameter is what the whole draw gives; a deeper model shares the shallower one's
    values in every unit they have in common; another seed gives other values."""
    shallow = write_config("llama", tmp_path / "shallow")
    deep = tmp_path / "deep"
    AutoConfig.from_pretrained(shallow, num_hidden_layers=3).save_pretrained(deep)
    whole = dict(load_model(shallow, seed=4).named_parameters())
    meta = meta_model(shallow)
    fresh = Fresh(meta, decoder_layers(meta), seed=4)
    for name in reversed(fresh.names):
        assert torch.equal(fresh.whole(name), whole[name]), name
    deeper = dict(load_model(deep, seed=4).named_parameters())
    assert all(torch.equal(deeper[name], value) for name, value in whole.items())
    other = dict(load_model(shallow, seed=5).named_parameters())
    assert not any(torch.equal(other[name], value) for name, value in whole.items() if value.std() > 0)


def test_the_generator_is_left_seeded_by_the_run_seed(tmp_path: Path) -> None:
    load_model(write_config("llama", tmp_path), seed=6)
    after = torch.rand(4)
    torch.manual_seed(6)
    assert torch.equal(after, torch.rand(4))


def test_an_architecture_whose_init_leaves_a_parameter_unset_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write_config("llama", tmp_path)
    family = type(meta_model(folder)).__mro__[1]  # LlamaPreTrainedModel: the head's and the body's class both
    skips_norms = family._init_weights

    def init(self: torch.nn.Module, module: torch.nn.Module) -> None:
        if "RMSNorm" not in type(module).__name__:
            skips_norms(self, module)

    monkeypatch.setattr(family, "_init_weights", init)
    with pytest.raises(UsageError, match=r"model type 'llama': its _init_weights leaves model\.layers\.0\.\S+norm"):
        load_model(folder, seed=0)

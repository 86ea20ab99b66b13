"""Each rank's shards read straight from a checkpoint's safetensors files (``diloco.shards``), here in a group of
one in this process: the model equals what ``from_pretrained`` gives, ties and computed buffers included. (A group
of two ranks, where each reads half: ``tests/integration/test_shards.py``.)"""

from __future__ import annotations

import gc
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from diloco.errors import UsageError
from diloco.model import (
    checkpoint_of,
    decoder_layers,
    load_model,
    params_sha256,
    refuse_misfits,
)
from diloco.shards import Checkpoint, parameters_to_meta, tied_aliases
from tests.support.architectures import ARCHITECTURES, write_config


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    """A gloo group of one in this process, and its mesh."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def saved(model_type: str, folder: Path, dtype: torch.dtype, shard_size: str | None = None) -> Path:
    """A fresh tiny `model_type` saved with weights in `dtype` (in several files with an index for `shard_size`)."""
    model = load_model(write_config(model_type, folder / "config"), seed=7)
    model.to(dtype).save_pretrained(folder / "weights", **({"max_shard_size": shard_size} if shard_size else {}))
    return folder / "weights"


def read_shards(path: Path, mesh: DeviceMesh) -> torch.nn.Module:
    """What a rank of an FSDP group does: the model on the meta device, sharded, its shards read from `path`."""
    model = load_model(path, seed=0, meta=True)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    checkpoint = checkpoint_of(path)
    assert checkpoint is not None and checkpoint.misfits(model) == []
    checkpoint.load_into(model, torch.device("cpu"))
    return model


def whole(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.full_tensor() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()]


@pytest.mark.parametrize(("model_type", "dtype", "shard_size"), [
    ("llama", torch.float32, None), ("gpt2", torch.bfloat16, "20KB"), ("qwen2", torch.float32, "20KB"),
    ("gemma2", torch.bfloat16, None),
])  # fmt: skip
def test_shards_read_from_the_files_make_the_model_from_pretrained_makes(
    tmp_path: Path, mesh: DeviceMesh, model_type: str, dtype: torch.dtype, shard_size: str | None
) -> None:
    """Untied llama; GPT-2 (Conv1D, tied) and Qwen2 (tied) in several files with an index; Gemma-2 in bfloat16:
    the same float32 parameters as ``from_pretrained``, a tie still one parameter, the computed buffers alike."""
    if model_type not in ARCHITECTURES:
        pytest.fail(f"this transformers lacks {model_type}")
    path = saved(model_type, tmp_path, dtype, shard_size)
    assert (path / "model.safetensors.index.json").exists() == (shard_size is not None)
    expected = load_model(path, seed=0)
    model = read_shards(path, mesh)
    assert all(p.dtype == torch.float32 and not p.is_meta for p in model.parameters())
    assert params_sha256(whole(model)) == params_sha256(list(expected.named_parameters()))
    assert tied_aliases(model) == tied_aliases(expected)
    for alias, name in tied_aliases(model).items():  # the tie survives: one parameter under both names
        assert model.get_parameter(alias) is model.get_parameter(name)
    buffers = dict(expected.named_buffers())
    assert {n: torch.equal(b, buffers[n]) for n, b in model.named_buffers()} == {n: True for n in buffers}


def test_a_checkpoint_that_does_not_fit_the_config_names_its_misfits(tmp_path: Path) -> None:
    """A config.json with one layer more than the files, or another width: the misfits are named, and refused in
    one line naming the flag and the folder."""
    path = saved("llama", tmp_path, torch.float32)
    config = json.loads((path / "config.json").read_text())
    checkpoint = Checkpoint.find(path)
    for change, named in (({"num_hidden_layers": 3}, r"model\.layers\.2\."), ({"intermediate_size": 96}, r".*\.mlp\.")):
        (path / "config.json").write_text(json.dumps(config | change))
        misfits = checkpoint.misfits(load_model(path, seed=0, meta=True))
        assert misfits and all(re.match(named, name) for name in misfits), misfits
        with pytest.raises(UsageError, match=r"path_model.*weights.*do not fit") as raised:
            refuse_misfits(path, misfits)
        assert "\n" not in str(raised.value)


def test_a_folder_without_safetensors_weights_has_no_checkpoint_and_a_damaged_one_is_a_usage_error(
    tmp_path: Path,
) -> None:
    path = saved("llama", tmp_path, torch.float32)
    assert checkpoint_of(tmp_path / "config") is None  # config.json alone: a fresh initialisation
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UsageError, match=r"path_model.*could not load the weights"):
        checkpoint_of(path)


def test_a_meta_build_leaves_the_generator_alone_and_computes_the_buffers(tmp_path: Path) -> None:
    path = write_config("llama", tmp_path / "config")
    torch.manual_seed(11)
    state = torch.get_rng_state()
    model = load_model(path, seed=0, meta=True)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())


def test_parameters_to_meta_leaves_the_state_dict_the_only_holder_of_each_tensor(tmp_path: Path) -> None:
    """What rank 0 does before sending its model: its parameters go to the meta device (a tie stays one parameter),
    and the state dict it returns holds the values, so dropping a tensor from it frees that tensor."""
    model = load_model(write_config("qwen2", tmp_path / "config"), seed=3)  # tied
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    state = parameters_to_meta(model)
    assert all(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    assert tied_aliases(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert all(torch.equal(state[name], value) for name, value in expected.items())
    layer = state.pop("model.layers.0.mlp.up_proj.weight")
    address = layer.untyped_storage().data_ptr()

    def holds(o: object) -> bool:
        try:
            return isinstance(o, torch.Tensor) and not o.is_meta and o.untyped_storage().data_ptr() == address
        except RuntimeError:  # a tensor whose storage is gone (another test's)
            return False

    assert [o for o in gc.get_objects() if holds(o)] == [layer]  # no parameter of the model holds its memory any more

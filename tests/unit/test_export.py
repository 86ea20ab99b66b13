"""``final/`` written one tensor at a time (``diloco.weight_files``, ``diloco.export``): the files are what
safetensors and ``from_pretrained`` read, split as planned, and the folder holds what ``save_pretrained`` writes.
(A sharded group's export, gathered tensor by tensor over two ranks: ``tests/integration/test_train.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from diloco import parallel
from diloco.export import write_final
from diloco.model import decoder_layers, params_sha256
from diloco.weight_files import INDEX, SINGLE, WeightFiles, header, plan
from tests.support.architectures import ARCHITECTURES, write_config

TENSORS = {
    "a.float32": torch.randn(3, 5),
    "b.bfloat16": torch.randn(7, dtype=torch.bfloat16),
    "c.float16": torch.randn(2, 2, 2).to(torch.float16),
    "d.int64": torch.arange(11),
    "e.bool": torch.tensor([True, False, True]),
    "f.scalar": torch.tensor(2.5),
    "g.empty": torch.zeros(0, 4),
}


def entries_of(tensors: dict[str, torch.Tensor], max_file_bytes: int = 10**9) -> list:
    return plan([(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()], max_file_bytes)


def write(folder: Path, tensors: dict[str, torch.Tensor], max_file_bytes: int = 10**9) -> list[str]:
    files = WeightFiles(folder, entries_of(tensors, max_file_bytes))
    for name, tensor in tensors.items():
        files.write(name, tensor)
    return files.finish()


def read(folder: Path, files: list[str]) -> dict[str, torch.Tensor]:
    found = {}
    for file in files:
        with safe_open(folder / file, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            found |= {name: f.get_tensor(name) for name in f.keys()}
    return found


def test_every_dtype_and_shape_reads_back_bit_for_bit_with_safetensors(tmp_path: Path) -> None:
    assert write(tmp_path, TENSORS) == [SINGLE]
    back = read(tmp_path, [SINGLE])
    assert list(back) == list(TENSORS)
    for name, tensor in TENSORS.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE]  # no .partial left


def test_the_header_is_padded_so_the_tensors_start_8_byte_aligned() -> None:
    for n in range(1, 12):
        made = header(entries_of({"x" * n: torch.zeros(n)}))
        length = int.from_bytes(made[:8], "little")
        assert len(made) == 8 + length and len(made) % 8 == 0, n
        assert json.loads(made[8:])["x" * n] == {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}


def test_files_split_at_the_limit_and_a_bigger_tensor_gets_a_file_of_its_own(tmp_path: Path) -> None:
    tensors = {"a": torch.zeros(10), "b": torch.ones(10), "c": torch.full((40,), 3.0), "d": torch.full((5,), 4.0)}
    files = write(tmp_path, tensors, max_file_bytes=80)  # 40 + 40 | 160 | 20 bytes
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["weight_map"] == {"a": files[0], "b": files[0], "c": files[1], "d": files[2]}
    assert index["metadata"]["total_size"] == 4 * 65
    back = read(tmp_path, files)
    assert all(torch.equal(back[name], t) for name, t in tensors.items())
    assert not (tmp_path / SINGLE).exists()


def test_a_former_export_in_another_split_is_replaced_not_mixed_in(tmp_path: Path) -> None:
    tensors = {"a": torch.zeros(10), "b": torch.ones(10)}
    write(tmp_path, tensors, max_file_bytes=40)  # two files and an index
    (tmp_path / "notes.txt").write_text("the user's")
    assert write(tmp_path, tensors) == [SINGLE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.txt"]
    write(tmp_path, tensors, max_file_bytes=40)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX, "notes.txt"]  # fmt: skip


def test_a_tensor_out_of_plan_or_missing_is_an_error(tmp_path: Path) -> None:
    files = WeightFiles(tmp_path, entries_of(TENSORS))
    with pytest.raises(ValueError, match="expected a.float32"):
        files.write("b.bfloat16", TENSORS["b.bfloat16"])
    with pytest.raises(ValueError, match=r"expected a.float32 torch.float32 \[3, 5\], got a.float32 \S+ \[5, 3\]"):
        files.write("a.float32", torch.zeros(5, 3))
    files.write("a.float32", TENSORS["a.float32"])
    with pytest.raises(ValueError, match="6 tensors were not written, from b.bfloat16"):
        files.finish()


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_final_is_what_save_pretrained_writes_and_loads_bit_for_bit(tmp_path: Path, model_type: str) -> None:
    """Every architecture: the same names (a tied weight once), config.json and generation config as
    ``save_pretrained``; from_pretrained gives the model back, and the hash is params_sha256 of the model."""
    config = AutoConfig.from_pretrained(write_config(model_type, tmp_path / "config"))
    model = AutoModelForCausalLM.from_config(config)
    sha = write_final(model, tmp_path / "final", max_file_bytes=100_000)  # split: several files and an index
    model.save_pretrained(tmp_path / "library")
    with safe_open(tmp_path / "library" / SINGLE, "pt") as f:
        names = sorted(f.keys())
    index = json.loads((tmp_path / "final" / INDEX).read_text())
    assert sorted(index["weight_map"]) == names and len(set(index["weight_map"].values())) > 1
    for file in ("config.json", "generation_config.json"):
        ours, library = (json.loads((tmp_path / folder / file).read_text()) for folder in ("final", "library"))
        assert ours == library, file
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert sha == params_sha256(list(model.named_parameters())) == params_sha256(list(back.named_parameters()))


def test_a_sharded_model_is_gathered_a_tensor_at_a_time_into_the_same_final(
    tmp_path: Path, one_process_group: None
) -> None:
    """FSDP2's DTensor parameters: the export and the hash are those of the same model unsharded."""
    config = AutoConfig.from_pretrained(write_config("qwen2", tmp_path / "config"))  # tied
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    mesh = init_device_mesh("cpu", (1,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sha = write_final(model, tmp_path / "final")
    assert sha == parallel.params_sha(model) == params_sha256(list(reference.named_parameters()))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert params_sha256(list(back.named_parameters())) == sha
    assert back.lm_head.weight is back.model.embed_tokens.weight

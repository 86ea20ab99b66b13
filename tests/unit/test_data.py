"""Data: tokenizers, file formats, packing without padding, disjoint shards, resumable positions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from diloco.cli.app import as_flags
from diloco.data import (
    ByteTokenizer,
    FakeBatches,
    Shard,
    build_data,
    build_tokenizer,
    pack,
    tokenize_corpus,
)
from diloco.errors import FieldError, UsageError
from tests.support.paths import CORPUS


def data(dataset: Path | None, shard: Shard, eval_shard: Shard | None = None, **overrides: object):
    kwargs = dict(
        dataset=dataset, tokenizer_spec=None, vocab_size=1024, seq_length=32, batch_size=4, eval_steps=3, seed=0,
        shard=shard, eval_shard=eval_shard or Shard(0, 1),
    )  # fmt: skip
    kwargs.update(overrides)
    return build_data(**kwargs)


def test_byte_tokenizer_round_trip() -> None:
    ids = ByteTokenizer().encode("héllo")
    assert ids.tolist() == list("héllo".encode())
    assert ids.max() < ByteTokenizer.vocab_size


def test_documents_are_packed_without_padding(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.txt").write_text("de")
    tokens = tokenize_corpus(tmp_path, ByteTokenizer())
    eos = ByteTokenizer.eos_token_id
    assert tokens.tolist() == [97, 98, 99, eos, 100, 101, eos]  # EOS separates documents, nothing is padded
    train, held_out = pack(np.arange(105), 10)
    assert train.shape == (9, 10) and held_out.shape == (1, 10)
    assert np.array_equal(np.concatenate([train.ravel(), held_out.ravel()]), np.arange(100))


def test_jsonl_and_parquet_read_the_text_field(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "xy"}) + "\n\n" + json.dumps({"text": "z"}) + "\n")
    pq.write_table(pa.table({"text": ["pq"]}), tmp_path / "e.parquet")
    eos = ByteTokenizer.eos_token_id
    assert tokenize_corpus(tmp_path / "d.jsonl", ByteTokenizer()).tolist() == [120, 121, eos, 122, eos]
    assert tokenize_corpus(tmp_path / "e.parquet", ByteTokenizer()).tolist() == [112, 113, eos]
    assert len(tokenize_corpus(tmp_path, ByteTokenizer())) == 8  # the folder holds both files


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.txt", "", "empty"),
        ("bad.jsonl", '{"body": "x"}\n', "bad.jsonl:1: each JSON line needs a string 'text' field"),
        ("data.csv", "a,b\n", "unsupported file type"),
    ],
)
def test_bad_dataset_files(tmp_path: Path, name: str, content: str, message: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(UsageError, match=message):
        tokenize_corpus(tmp_path / name, ByteTokenizer())


def test_dataset_too_small_for_the_ranks(tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("x" * 300)
    with pytest.raises(FieldError) as failed:
        data(tmp_path / "tiny.txt", Shard.of(0, 2, 0, 2))
    assert re.search("--dataset .* need at least", str(as_flags(failed.value)))  # as the command line reports it


def test_shards_are_disjoint_across_ranks_and_groups() -> None:
    """Every (world rank, rank) pair reads its own blocks; held-out blocks are never trained on."""
    seen: dict[tuple[int, ...], tuple[int, int]] = {}
    for world_rank in range(2):
        for rank in range(2):
            source = data(CORPUS, Shard.of(world_rank, 2, rank, 2)).train
            for row in source.blocks:
                key = tuple(row.tolist())
                assert seen.setdefault(key, (world_rank, rank)) == (world_rank, rank)
    held_out = data(CORPUS, Shard(0, 1)).eval_batches
    assert held_out and all(tuple(row.tolist()) not in seen for batch in held_out for row in batch)


def test_eval_split_is_the_same_for_every_group_and_equal_per_rank() -> None:
    a = data(CORPUS, Shard.of(0, 2, 0, 2), eval_shard=Shard(0, 2)).eval_batches
    b = data(CORPUS, Shard.of(1, 2, 0, 2), eval_shard=Shard(0, 2)).eval_batches
    c = data(CORPUS, Shard.of(1, 2, 1, 2), eval_shard=Shard(1, 2)).eval_batches
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert len(a) == len(c) == 3 and not torch.equal(a[0], c[0])


def test_position_resumes_exactly_across_epochs() -> None:
    first = data(CORPUS, Shard(0, 1)).train
    batches = [first.next_batch() for _ in range(first.batches_per_epoch + 3)]
    again = data(CORPUS, Shard(0, 1)).train
    again.load_state_dict({"position": first.batches_per_epoch + 1})
    assert torch.equal(again.next_batch(), batches[first.batches_per_epoch + 1])
    # a new epoch is a new order of the same blocks
    assert not torch.equal(batches[0], batches[first.batches_per_epoch])


def test_fake_data_is_deterministic_by_seed_and_shard() -> None:
    def first(seed: int, shard: int) -> torch.Tensor:
        return FakeBatches(1024, 16, Shard(shard, 2), 2, seed).next_batch()

    assert torch.equal(first(1, 0), first(1, 0))
    assert not torch.equal(first(1, 0), first(2, 0)) and not torch.equal(first(1, 0), first(1, 1))
    source = FakeBatches(1024, 16, Shard(0, 1), 2, 5)
    source.next_batch()
    resumed = FakeBatches(1024, 16, Shard(0, 1), 2, 5)
    resumed.load_state_dict(source.state_dict())
    assert torch.equal(resumed.next_batch(), source.next_batch())


def test_local_hf_tokenizer_folder(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[EOS]": 0, "[UNK]": 1, "to": 2, "be": 3, "or": 4, "not": 5}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="[EOS]", unk_token="[UNK]").save_pretrained(tmp_path)
    tokenizer = build_tokenizer(str(tmp_path))
    assert tokenizer.encode("to be or not to be").tolist() == [2, 3, 4, 5, 2, 3]
    (tmp_path / "text.txt").write_text("to be or not to be " * 200)
    with pytest.raises(FieldError) as failed:
        data(tmp_path / "text.txt", Shard(0, 1), tokenizer_spec=str(tmp_path), vocab_size=4)
    assert str(as_flags(failed.value)) == "--tokenizer has 6 tokens but the model in --path-model only 4"
    batches = data(tmp_path / "text.txt", Shard(0, 1), tokenizer_spec=str(tmp_path), seq_length=8).train
    assert batches.next_batch().max() < 6

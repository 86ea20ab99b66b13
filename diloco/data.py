"""Training data: fake tokens, local text files or a hub dataset, tokenized, packed into blocks, sharded, resumable.

Every rank of every worker group reads a disjoint shard: shard index = world_rank × ranks + rank. A batch is a
pure function of (seed, shard, position), so the data position is one integer and resuming is exact.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from diloco import hub
from diloco.errors import FieldError, first_line

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
EVAL_FRACTION = 0.1  # share of packed blocks held out for evaluation


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int

    def encode(self, text: str) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, 256 = BOS, 257 = EOS (matching the shipped model configs). No download."""

    vocab_size = 258
    bos_token_id = 256
    eos_token_id = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


class HFTokenizer:
    """A tokenizer from a local Hugging Face folder, or a hub id's snapshot in the Hugging Face cache."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        folder = hub.local_folder("tokenizer", path, hub.TOKENIZER_FILES)
        try:
            self.inner = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError) as e:
            raise FieldError(f"{{tokenizer}} {path}: not a loadable tokenizer folder ({first_line(e)})") from None
        if self.inner.eos_token_id is None:
            raise FieldError(f"{{tokenizer}} {path}: it defines no EOS token, needed to separate documents")
        self.vocab_size = len(self.inner)
        self.eos_token_id = self.inner.eos_token_id

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.inner(text, add_special_tokens=False)["input_ids"], dtype=np.int32)


def build_tokenizer(spec: str | None) -> Tokenizer:
    return ByteTokenizer() if spec is None else HFTokenizer(spec)


@dataclass(frozen=True)
class Shard:
    """Which slice of the data this rank reads: `index` of `count` disjoint shards."""

    index: int
    count: int

    def take(self, rows: np.ndarray) -> np.ndarray:
        """This shard's equal share of `rows` (a remainder of fewer than `count` rows is left out)."""
        per_shard = len(rows) // self.count
        return rows[self.index * per_shard : (self.index + 1) * per_shard]

    @classmethod
    def of(cls, world_rank: int, galaxy_size: int, rank: int, world_size: int) -> Shard:
        return cls(index=world_rank * world_size + rank, count=galaxy_size * world_size)


# ---------------------------------------------------------------- reading files


def dataset_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix not in TEXT_SUFFIXES:
            raise FieldError(f"{{dataset}} {path}: unsupported file type (use {', '.join(TEXT_SUFFIXES)})")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise FieldError(f"{{dataset}} {path}: the folder holds no {', '.join(TEXT_SUFFIXES)} file")
    return files


def read_documents(path: Path) -> Iterator[str]:
    """Each .txt file is one document; each .jsonl line and .parquet row is one, from its `text` field."""
    if path.suffix == ".txt":
        yield path.read_text(encoding="utf-8", errors="replace")
    elif path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield _text_field(json.loads(line), f"{path}:{number}")
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if "text" not in table.column_names:
            raise FieldError(f"{{dataset}} {path}: no 'text' column (columns: {', '.join(table.column_names)})")
        yield from (text for text in table.column("text").to_pylist() if text)


def _text_field(record: object, where: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise FieldError(f"{{dataset}} {where}: each JSON line needs a string 'text' field")
    return record["text"]


def hub_documents(name: str, config: str | None = None) -> Iterator[str]:
    """The `text` column of a hub dataset's train split (of configuration `config`), through `datasets` (imported
    only here: it is slow to import). A snapshot in the hub cache (`hf download --repo-type dataset`) is read as a
    local folder, since `datasets` does not look there offline (a configuration is then its subfolder, as hub
    repos such as wikitext lay them out); otherwise `datasets` finds its own prepared cache, or downloads."""
    import datasets

    datasets.disable_progress_bars()  # a bar per rank and file only clutters the run's log
    snapshot = None
    try:
        # under the machine's lock: a rank that downloads the id fills its snapshot folder file by file
        with hub.download_lock(name, "dataset"):
            snapshot = hub.cached_snapshot(name, "dataset")
            if snapshot is None:
                source, options = name, {"name": config}
            elif config is not None and (snapshot / config).is_dir():
                source, options = str(snapshot), {"data_dir": config}
            else:
                source, options = str(snapshot), {"name": config}
            table = datasets.load_dataset(source, split="train", **options)
    except Exception as e:  # datasets, huggingface_hub, httpx and pyarrow each raise their own types
        if snapshot is None and not hub.in_datasets_cache(name):
            raise hub.not_found("dataset", name, first_line(e)) from None
        which = f"the train split of configuration {config}" if config else "its train split"
        raise FieldError(f"{{dataset}} {name}: could not load {which} ({first_line(e)})") from None
    if "text" not in table.column_names:
        raise FieldError(f"{{dataset}} {name}: no 'text' column (columns: {', '.join(table.column_names)})")
    yield from (text for text in table["text"] if text)


def documents(dataset: Path, config: str | None = None) -> Iterator[str]:
    """A local file or folder keeps priority over a hub dataset id of the same spelling."""
    if hub.is_hub_id(str(dataset)):
        yield from hub_documents(str(dataset), config)
        return
    for file in dataset_files(dataset):
        yield from read_documents(file)


def tokenize_corpus(path: Path, tokenizer: Tokenizer, config: str | None = None) -> np.ndarray:
    """All documents as one token stream, each followed by EOS (EOS is trained on, never masked). `config`: the
    configuration of a hub dataset."""
    pieces: list[np.ndarray] = []
    eos = np.array([tokenizer.eos_token_id], dtype=np.int32)
    try:
        for text in documents(path, config):
            pieces += [tokenizer.encode(text), eos]
    except (OSError, json.JSONDecodeError, UnicodeError) as e:
        raise FieldError(f"{{dataset}} {path}: could not read it ({first_line(e)})") from None
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    if len(tokens) <= len(pieces) // 2:  # nothing but separators
        raise FieldError(f"{{dataset}} {path}: the dataset is empty")
    return tokens


def pack(tokens: np.ndarray, seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut the stream into (blocks, seq_length) with no padding; the last 10% of blocks are held out."""
    num_blocks = len(tokens) // seq_length
    blocks = tokens[: num_blocks * seq_length].reshape(num_blocks, seq_length)
    num_eval = int(num_blocks * EVAL_FRACTION)
    return blocks[: num_blocks - num_eval], blocks[num_blocks - num_eval :]


# ---------------------------------------------------------------- batch sources


class BatchSource(Protocol):
    """An endless, resumable stream of (batch, seq_length) int64 token batches."""

    def next_batch(self) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


class BlockBatches:
    """Batches from one shard of packed blocks, reshuffled every epoch by (seed, epoch, shard)."""

    def __init__(self, blocks: np.ndarray, shard: Shard, batch_size: int, seed: int) -> None:
        self.blocks = shard.take(blocks)
        self.shard, self.batch_size, self.seed = shard, batch_size, seed
        self.batches_per_epoch = len(self.blocks) // batch_size
        self.position = 0  # micro-batches handed out so far

    def next_batch(self) -> torch.Tensor:
        epoch, index = divmod(self.position, self.batches_per_epoch)
        order = np.random.default_rng([self.seed, epoch, self.shard.index]).permutation(len(self.blocks))
        rows = order[index * self.batch_size : (index + 1) * self.batch_size]
        self.position += 1
        return torch.from_numpy(self.blocks[rows].astype(np.int64))

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


class FakeBatches:
    """Uniform random tokens; batch i of a shard is the same on every run with the same seed."""

    def __init__(self, vocab_size: int, seq_length: int, shard: Shard, batch_size: int, seed: int) -> None:
        self.vocab_size, self.seq_length, self.shard = vocab_size, seq_length, shard
        self.batch_size, self.seed = batch_size, seed
        self.position = 0

    def next_batch(self) -> torch.Tensor:
        entropy = np.random.SeedSequence([self.seed, self.shard.index, self.position]).generate_state(2, np.uint64)
        generator = torch.Generator().manual_seed(int(entropy[0] >> np.uint64(1)))
        self.position += 1
        return torch.randint(self.vocab_size, (self.batch_size, self.seq_length), generator=generator)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


@dataclass
class Data:
    train: BatchSource
    eval_batches: list[torch.Tensor]  # this rank's held-out batches; empty when there is no eval split
    tokens_per_batch: int
    about: str = ""  # one line for the start-up banner: what the data is and how much of it
    batches_per_epoch: int | None = None  # micro-batches in one pass over this rank's share; None: fake data

    def steps_per_epoch(self, grad_accum: int) -> int | None:
        """Inner steps in one pass over the share (the same on every rank of every group: shards are equal)."""
        return None if self.batches_per_epoch is None else self.batches_per_epoch // grad_accum


def build_data(
    *,
    dataset: Path | None,
    dataset_config: str | None = None,
    tokenizer_spec: str | None,
    vocab_size: int,
    seq_length: int,
    batch_size: int,
    eval_steps: int,
    seed: int,
    shard: Shard,
    eval_shard: Shard,
) -> Data:
    """`shard` splits training data over every rank of every group; `eval_shard` splits the held-out data over
    the ranks of this group only, so all groups evaluate on the same text."""
    tokens_per_batch = batch_size * seq_length
    if dataset is None:
        fake = FakeBatches(vocab_size, seq_length, shard, batch_size, seed)
        held_out = FakeBatches(vocab_size, seq_length, eval_shard, batch_size, seed + 1_000_003)
        about = f"fake (random tokens of {vocab_size}, seed {seed})"
        return Data(fake, [held_out.next_batch() for _ in range(eval_steps)], tokens_per_batch, about)

    tokenizer = build_tokenizer(tokenizer_spec)
    if tokenizer.vocab_size > vocab_size:
        raise FieldError(
            f"{{tokenizer}} has {tokenizer.vocab_size} tokens but the model in {{path_model}} only {vocab_size}"
        )
    tokens = tokenize_corpus(dataset, tokenizer, dataset_config)
    train_blocks, eval_blocks = pack(tokens, seq_length)
    needed = shard.count * batch_size
    if len(train_blocks) < needed:
        raise FieldError(
            f"{{dataset}} {dataset}: {len(train_blocks)} training blocks of {{seq_length}} {seq_length}, but "
            f"{shard.count} ranks × {{per_device_train_batch_size}} {batch_size} need at least {needed}"
        )
    train = BlockBatches(train_blocks, shard, batch_size, seed)
    name = f"{dataset.name} ({dataset_config})" if dataset_config else dataset.name
    about = (
        f"{name}: {len(tokens):,} tokens, {len(train_blocks):,} train / {len(eval_blocks):,} held-out blocks "
        f"of {seq_length} ({len(train.blocks):,} train blocks for this rank)"
    )
    held_out = _eval_batches(eval_blocks, eval_shard, batch_size, eval_steps)
    return Data(train, held_out, tokens_per_batch, about, batches_per_epoch=train.batches_per_epoch)


def _eval_batches(blocks: np.ndarray, shard: Shard, batch_size: int, eval_steps: int) -> list[torch.Tensor]:
    """In-order held-out batches, as many on every rank (each is a forward with FSDP collectives); none when
    the held-out split is too small to give every rank a block."""
    if len(blocks) < shard.count:
        return []
    mine = torch.from_numpy(shard.take(blocks).astype(np.int64))
    return list(mine.split(batch_size))[:eval_steps]

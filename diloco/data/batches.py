"""Batches: fake tokens, or a corpus's token store cut into blocks, sharded, shuffled, resumable.

Every rank of every worker group reads a disjoint shard: shard index = world_rank × ranks + rank. A batch is a
pure function of (seed, shard, position), so the data position is one integer and resuming is exact. A rank reads
only the blocks of its batches from the store (``diloco.data.store``): its memory does not grow with the corpus.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from diloco.data.store import default_root, open_store
from diloco.data.tokenizers import build_tokenizer
from diloco.errors import FieldError

Blocks = Any  # an ndarray of (blocks, seq_length) ids, or ``store.StoredBlocks``: sliced, indexed by arrays, len()

EVAL_FRACTION = 0.1  # share of packed blocks held out for evaluation


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
    """Batches from one shard of packed blocks (in memory or in a token store), reshuffled every epoch by (seed,
    epoch, shard)."""

    def __init__(self, blocks: Blocks, shard: Shard, batch_size: int, seed: int) -> None:
        self.blocks = shard.take(blocks)
        self.shard, self.batch_size, self.seed = shard, batch_size, seed
        self.batches_per_epoch = len(self.blocks) // batch_size
        self.position = 0  # micro-batches handed out so far
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its order): drawn once per epoch

    def next_batch(self) -> torch.Tensor:
        epoch, index = divmod(self.position, self.batches_per_epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = epoch, np.random.default_rng([self.seed, epoch, self.shard.index]).permutation(len(self.blocks))
        rows = self._order[1][index * self.batch_size : (index + 1) * self.batch_size]
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
    token_cache: Path | None = None,
) -> Data:
    """`shard` splits training data over every rank of every group; `eval_shard` splits the held-out data over
    the ranks of this group only, so all groups evaluate on the same text. A corpus is read from its token store
    under `token_cache` (``store.default_root()`` when None), built there first if it is not."""
    tokens_per_batch, started = batch_size * seq_length, time.monotonic()
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
    stored = open_store(dataset, dataset_config, tokenizer, token_cache or default_root())
    train_blocks, eval_blocks = stored.blocks(seq_length, EVAL_FRACTION)
    needed = shard.count * batch_size
    if len(train_blocks) < needed:
        raise FieldError(
            f"{{dataset}} {dataset}: {len(train_blocks)} training blocks of {{seq_length}} {seq_length}, but "
            f"{shard.count} ranks × {{per_device_train_batch_size}} {batch_size} need at least {needed}"
        )
    train = BlockBatches(train_blocks, shard, batch_size, seed)
    name = f"{dataset.name} ({dataset_config})" if dataset_config else dataset.name
    about = (
        f"{name}: {stored.count:,} tokens, {len(train_blocks):,} train / {len(eval_blocks):,} held-out blocks "
        f"of {seq_length} ({len(train.blocks):,} train blocks for this rank; token store {stored.path.parent}"
    )
    held_out = _eval_batches(eval_blocks, eval_shard, batch_size, eval_steps)
    about += f"; ready in {time.monotonic() - started:.1f} s)"
    return Data(train, held_out, tokens_per_batch, about, batches_per_epoch=train.batches_per_epoch)


def _eval_batches(blocks: Blocks, shard: Shard, batch_size: int, eval_steps: int) -> list[torch.Tensor]:
    """In-order held-out batches, as many on every rank (each is a forward with FSDP collectives); none when
    the held-out split is too small to give every rank a block. Only the blocks of those batches are read."""
    if len(blocks) < shard.count:
        return []
    mine = shard.take(blocks)[: batch_size * eval_steps]
    return list(torch.from_numpy(np.asarray(mine.astype(np.int64))).split(batch_size))

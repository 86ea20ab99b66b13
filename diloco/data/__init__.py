"""Training data, in layers: the documents of a corpus (``documents``), tokenizers (``tokenizers``), the token store
that a corpus is tokenized into once per machine (``store``), and the batches each rank reads (``batches``)."""

from diloco.data.batches import (
    EVAL_FRACTION,
    BatchSource,
    BlockBatches,
    Data,
    FakeBatches,
    Shard,
    build_data,
    pack,
)
from diloco.data.documents import (
    TEXT_SUFFIXES,
    dataset_files,
    hub_documents,
)
from diloco.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    build_tokenizer,
    tokenize_corpus,
)

__all__ = [
    "EVAL_FRACTION", "TEXT_SUFFIXES", "BatchSource", "BlockBatches", "ByteTokenizer", "Data", "FakeBatches",
    "HFTokenizer", "Shard", "Tokenizer", "build_data", "build_tokenizer", "dataset_files", "hub_documents", "pack",
    "tokenize_corpus",
]  # fmt: skip

"""Tokenizers: UTF-8 bytes, or a Hugging Face tokenizer; each with a fingerprint that names its vocabulary (a token
store is keyed by it)."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Protocol

import numpy as np

from diloco import hub
from diloco.data.documents import pieces
from diloco.errors import FieldError, first_line


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int
    fingerprint: str  # the same for two tokenizers that give the same ids

    def encode(self, text: str) -> np.ndarray: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, 256 = BOS, 257 = EOS (matching the shipped model configs). No download."""

    vocab_size = 258
    bos_token_id = 256
    eos_token_id = 257
    fingerprint = "bytes-258"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]


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
        self.fingerprint = f"hf-{folder_digest(Path(folder))}"

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.inner(text, add_special_tokens=False)["input_ids"], dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The texts together, each cut into parts of a few KB at line starts (`parts`): a fast tokenizer spreads
        the parts over the cores, and is four times faster on them than on one text of megabytes."""
        split = [parts(text) for text in texts]
        flat = [part for cut in split for part in cut]
        backend = getattr(self.inner, "backend_tokenizer", None)
        if backend is not None:
            ids = [encoding.ids for encoding in backend.encode_batch(flat, add_special_tokens=False)]
        else:
            ids = self.inner(flat, add_special_tokens=False)["input_ids"]
        out, at = [], 0
        for cut in split:
            out.append(np.fromiter(itertools.chain.from_iterable(ids[at : at + len(cut)]), dtype=np.int32))
            at += len(cut)
        return out


PART_CHARS = 4096  # what `HFTokenizer.encode_batch` cuts texts into


def parts(text: str, size: int = PART_CHARS) -> list[str]:
    """`text` in parts of at most about `size` characters, each cut after a line end that a visible character
    follows (a BPE pre-tokenizer splits there anyway), else after a space, else anywhere; [text] when short."""
    out, start = [], 0
    while len(text) - start > size:
        cut = text.rfind("\n", start, start + size)
        while cut >= start and text[cut + 1].isspace():
            cut = text.rfind("\n", start, cut)
        if cut < start:
            cut = text.rfind(" ", start, start + size)
        end = cut + 1 if cut >= start else start + size
        out.append(text[start:end])
        start = end
    return [*out, text[start:]]


def folder_digest(folder: Path) -> str:
    """A short digest of the tokenizer files at the top of `folder` (names and bytes; ``hub.TOKENIZER_FILES``)."""
    digest = hashlib.sha256()
    files = sorted({f for pattern in hub.TOKENIZER_FILES for f in folder.glob(pattern) if f.is_file()})
    for file in files:
        digest.update(file.name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()[:16]


def build_tokenizer(spec: str | None) -> Tokenizer:
    return ByteTokenizer() if spec is None else HFTokenizer(spec)


def tokenize_corpus(path: Path, tokenizer: Tokenizer, config: str | None = None) -> np.ndarray:
    """All documents as one token stream in memory, each followed by EOS (EOS is trained on, never masked): for
    corpora that fit in memory (a run's data goes through the token store, ``diloco.data.store``). `config`: the
    configuration of a hub dataset."""
    parts: list[np.ndarray] = []
    eos = np.array([tokenizer.eos_token_id], dtype=np.int32)
    documents = 0
    for piece in pieces(path, config):
        parts.append(tokenizer.encode(piece.text))
        if piece.ends:
            parts.append(eos)
            documents += 1
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    if len(tokens) <= documents:  # nothing but separators
        raise FieldError(f"{{dataset}} {path}: the dataset is empty")
    return tokens

"""The token store: a corpus tokenized once per machine into a flat file of token ids, which every rank of every
group on the machine reads block by block (``StoredBlocks``), so a rank's memory does not grow with the corpus.

Why a flat file and not the `datasets` Arrow cache: packing cuts one token stream into blocks of any
--seq-length, so a flat stream serves every sequence length from one store (an Arrow table of documents would be
re-packed, in memory, at each start), and reading a block is one `pread` of its bytes. Ids are uint16 when the
vocabulary fits (half the disk of uint32), else uint32.

A store is a folder under the cache root named by its key: a digest of the corpus (each file's size, modification
time and sampled bytes; a hub dataset's id, configuration and cached snapshot), the tokenizer's fingerprint and
this format's version. It holds ``tokens.bin`` and ``manifest.json``, written last; the folder is built under
another name and renamed into place, under a file lock: the first process builds it, with a progress line, while
the others wait. A store whose file does not match its manifest (size, sampled digests) is damaged: rebuilt, with
one line saying so. A manifest naming another tokenizer than the key's is refused (FieldError).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diloco import hub
from diloco.data.documents import dataset_files, pieces
from diloco.data.tokenizers import Tokenizer
from diloco.errors import FieldError

log = logging.getLogger("diloco.data")  # INFO on every rank (`console.setup_logging`)

VERSION = 1
SAMPLES, SAMPLE_BYTES = 16, 1 << 16  # windows of a store's file whose digests its manifest keeps
CORPUS_SAMPLE_BYTES = 1 << 20  # of each corpus file, the first, middle and last this many bytes go into the key
BATCH_CHARS = 1 << 22  # text encoded at a time (a fast tokenizer spreads one batch over the cores)
PROGRESS_S = 10.0  # a progress line this often while a store is built


def default_root() -> Path:
    """Where token stores go without --token-cache: ``$XDG_CACHE_HOME/diloco/tokens``, else ``~/.cache/...``."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "diloco" / "tokens"


@dataclass(frozen=True)
class StoredTokens:
    """An opened store: `count` token ids of `dtype` in `path`."""

    path: Path
    dtype: np.dtype
    count: int
    documents: int

    def blocks(self, seq_length: int, eval_fraction: float) -> tuple[StoredBlocks, StoredBlocks]:
        """The stream cut into blocks of `seq_length` (no padding): the training blocks, then the last
        `eval_fraction` of them, held out."""
        total = self.count // seq_length
        held_out = int(total * eval_fraction)
        return (StoredBlocks(self.path, self.dtype, seq_length, 0, total - held_out),
                StoredBlocks(self.path, self.dtype, seq_length, total - held_out, total))  # fmt: skip


class StoredBlocks:
    """Blocks [start, stop) of a store, read on demand: a slice is another range, an array of indices reads those
    blocks (an array of (len(indices), seq_length) ids), an int one block."""

    def __init__(self, path: Path, dtype: np.dtype, seq_length: int, start: int, stop: int) -> None:
        self.path, self.dtype, self.seq_length, self.start, self.stop = path, dtype, seq_length, start, stop
        self.row_bytes = seq_length * dtype.itemsize

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, index: int | slice | np.ndarray) -> Any:
        if isinstance(index, (int, np.integer)):
            return self[np.array([index])][0]
        if isinstance(index, slice):
            begin, end, step = index.indices(len(self))
            if step != 1:
                raise ValueError("stored blocks are sliced in steps of 1")
            return StoredBlocks(self.path, self.dtype, self.seq_length, self.start + begin, self.start + max(begin, end))
        rows = np.asarray(index, dtype=np.int64).reshape(-1)
        out = np.empty((len(rows), self.seq_length), dtype=self.dtype)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for i, row in enumerate(rows):
                if not 0 <= row < len(self):
                    raise IndexError(f"block {row} of {len(self)}")
                data = os.pread(fd, self.row_bytes, (self.start + int(row)) * self.row_bytes)
                out[i] = np.frombuffer(data, dtype=self.dtype)
        finally:
            os.close(fd)
        return out

    def astype(self, dtype: Any) -> np.ndarray:
        """All of these blocks in memory (for a few held-out batches)."""
        return self[np.arange(len(self))].astype(dtype)


# ---------------------------------------------------------------- the key


def corpus_fingerprint(dataset: Path, config: str | None) -> dict[str, Any]:
    """What names a corpus's content: per local file its name within the dataset, size, modification time and the
    digest of its first, middle and last MB; for a hub id, the id, configuration and the cached snapshot's commit."""
    if hub.is_hub_id(str(dataset)):
        snapshot = hub.cached_snapshot(str(dataset), "dataset")
        return {"hub": str(dataset), "config": config, "snapshot": snapshot.name if snapshot else None}
    files = []
    for file in dataset_files(dataset):
        stat = file.stat()
        digest = hashlib.sha256()
        with file.open("rb") as f:
            for offset in sorted({0, max(0, stat.st_size // 2 - CORPUS_SAMPLE_BYTES // 2),
                                  max(0, stat.st_size - CORPUS_SAMPLE_BYTES)}):  # fmt: skip
                f.seek(offset)
                digest.update(f.read(CORPUS_SAMPLE_BYTES))
        name = file.name if file == dataset else str(file.relative_to(dataset))
        files.append([name, stat.st_size, stat.st_mtime_ns, digest.hexdigest()])
    return {"files": files}


def store_key(dataset: Path, config: str | None, tokenizer: Tokenizer) -> str:
    described = {"version": VERSION, "corpus": corpus_fingerprint(dataset, config), "tokenizer": tokenizer.fingerprint}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# ---------------------------------------------------------------- opening, building


def open_store(dataset: Path, config: str | None, tokenizer: Tokenizer, root: Path) -> StoredTokens:
    """The store of `dataset` tokenized by `tokenizer` under `root`: opened if it is there and whole, else built
    (by this process, or by another one on the machine that holds its lock while this one waits)."""
    key = store_key(dataset, config, tokenizer)
    folder = root / key
    found, _ = check(folder, tokenizer)
    if found is not None:
        return found
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FieldError(f"{{token_cache}} {root}: cannot create the token store there ({e.strerror})") from None
    with locked(root / f"{key}.lock", f"waiting for another process to tokenize {dataset.name} into {folder}"):
        found, why = check(folder, tokenizer)
        if found is not None:
            return found
        if folder.exists():
            log.warning("the token store %s is damaged (%s): building it again", folder, why)
            shutil.rmtree(folder)
        build(folder, dataset, config, tokenizer)
        found, why = check(folder, tokenizer)
    if found is None:
        raise RuntimeError(f"the token store {folder} just built does not check ({why})")
    return found


def check(folder: Path, tokenizer: Tokenizer) -> tuple[StoredTokens | None, str]:
    """The store in `folder` if it is whole (else None and why not); FieldError if it holds another tokenizer's
    ids."""
    manifest_path, tokens_path = folder / "manifest.json", folder / "tokens.bin"
    if not folder.is_dir():
        return None, "absent"
    try:
        manifest = json.loads(manifest_path.read_text())
        dtype, count, samples = np.dtype(manifest["dtype"]), int(manifest["tokens"]), manifest["samples"]
        written_by = manifest["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"no readable manifest: {type(e).__name__}"
    if written_by != tokenizer.fingerprint:
        raise FieldError(f"{{token_cache}} {folder}: a token store of another tokenizer ({written_by}) than "
                         f"{{tokenizer}}'s ({tokenizer.fingerprint}); remove the folder")  # fmt: skip
    try:
        size = tokens_path.stat().st_size
        if size != count * dtype.itemsize:
            return None, f"tokens.bin holds {size} bytes, its manifest says {count * dtype.itemsize}"
        if sampled_digests(tokens_path, size) != samples:
            return None, "tokens.bin does not match its manifest's digests"
    except OSError as e:
        return None, f"tokens.bin: {e.strerror}"
    return StoredTokens(tokens_path, dtype, count, int(manifest.get("documents", 0))), ""


def sampled_digests(path: Path, size: int) -> list[str]:
    """Digests of `SAMPLES` windows of `SAMPLE_BYTES` spread over the file (the whole of a small one)."""
    offsets = sorted({min(i * size // SAMPLES, max(0, size - SAMPLE_BYTES)) for i in range(SAMPLES)})
    with path.open("rb") as f:
        out = []
        for offset in offsets:
            f.seek(offset)
            out.append(hashlib.sha256(f.read(SAMPLE_BYTES)).hexdigest()[:16])
    return out


@contextlib.contextmanager
def locked(path: Path, waiting: str) -> Iterator[None]:
    """An exclusive lock on `path` (any process of the machine); says `waiting` (at DEBUG: the builder's progress
    lines say how far it got) if another holds it."""
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.debug("%s", waiting)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(folder: Path, dataset: Path, config: str | None, tokenizer: Tokenizer) -> None:
    """Tokenize `dataset` into `folder`, through a folder of another name renamed into place once whole (a build
    cut short leaves no store; the next build removes what it left)."""
    for stale in folder.parent.glob(f".{folder.name}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    building = folder.parent / f".{folder.name}.{os.getpid()}"
    building.mkdir()
    try:
        dtype = token_dtype(tokenizer.vocab_size)
        began = time.monotonic()
        count, documents, source_bytes = write_tokens(building / "tokens.bin", dataset, config, tokenizer, dtype)
        manifest = {"version": VERSION, "dtype": dtype.name, "tokens": count, "documents": documents,
                    "tokenizer": tokenizer.fingerprint, "corpus": corpus_fingerprint(dataset, config),
                    "samples": sampled_digests(building / "tokens.bin", count * dtype.itemsize),
                    "source_bytes": source_bytes, "build_seconds": time.monotonic() - began}  # fmt: skip
        (building / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        building.rename(folder)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise


def write_tokens(path: Path, dataset: Path, config: str | None, tokenizer: Tokenizer,
                 dtype: np.dtype) -> tuple[int, int, int]:  # fmt: skip
    """Every document's ids, then EOS, into `path` as `dtype`; a progress line every `PROGRESS_S`. Returns (ids
    written, documents, bytes of the source read)."""
    progress = Progress(dataset, corpus_bytes(dataset))
    count = documents = 0
    with path.open("wb") as out:
        batch: list = []

        def flush() -> None:
            nonlocal count, documents
            encoded = tokenizer.encode_batch([piece.text for piece in batch])
            for piece, ids in zip(batch, encoded):
                parts = [ids, np.array([tokenizer.eos_token_id])] if piece.ends else [ids]
                for part in parts:
                    out.write(part.astype(dtype).tobytes())
                    count += len(part)
                documents += piece.ends
                progress.advance(piece.nbytes)
            batch.clear()

        chars = 0
        for piece in pieces(dataset, config):
            batch.append(piece)
            chars += len(piece.text)
            if chars >= BATCH_CHARS:
                flush()
                chars = 0
        flush()
    if count <= documents:  # nothing but separators
        raise FieldError(f"{{dataset}} {dataset}: the dataset is empty")
    progress.done(count)
    return count, documents, progress.done_bytes


def corpus_bytes(dataset: Path) -> int | None:
    """The corpus's size in bytes of its files; None for a hub dataset (its size is not known ahead)."""
    if hub.is_hub_id(str(dataset)):
        return None
    return sum(file.stat().st_size for file in dataset_files(dataset))


class Progress:
    """The build's progress line every `PROGRESS_S` (bytes done of the total, rate, time left), and a last one; a
    build shorter than that says nothing (its figures are in the manifest)."""

    def __init__(self, dataset: Path, total: int | None) -> None:
        self.name, self.total, self.done_bytes = dataset.name, total, 0
        self.started = self.last = time.monotonic()

    def advance(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        now = time.monotonic()
        if now - self.last < PROGRESS_S:
            return
        self.last = now
        rate = self.done_bytes / max(now - self.started, 1e-9)
        if self.total:
            left = (self.total - self.done_bytes) / max(rate, 1e-9)
            log.info("tokenizing %s: %.0f of %.0f MB (%.0f%%), %.1f MB/s, %.0f s left", self.name, self.done_bytes / 1e6,
                     self.total / 1e6, 100 * self.done_bytes / self.total, rate / 1e6, left)  # fmt: skip
        else:
            log.info("tokenizing %s: %.0f MB, %.1f MB/s", self.name, self.done_bytes / 1e6, rate / 1e6)

    def done(self, count: int) -> None:
        """The last line, after progress lines only (a build of seconds says nothing: a run that then stops on bad
        input keeps its one line)."""
        seconds = time.monotonic() - self.started
        if seconds < PROGRESS_S:
            return
        log.info("tokenized %s: %s tokens in %.1f s (%.1f MB/s)", self.name, f"{count:,}", seconds,
                 self.done_bytes / 1e6 / max(seconds, 1e-9))  # fmt: skip

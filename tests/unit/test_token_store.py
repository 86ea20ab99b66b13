"""The token store (`diloco.data.store`): a corpus tokenized once into a flat file, read block by block; reused while
the corpus and tokenizer are the same, rebuilt when damaged, refused when another tokenizer wrote it; built by one
of several processes at a time while the others wait; and the batches it gives are those of the corpus in memory."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from diloco.data import (
    BlockBatches,
    ByteTokenizer,
    Shard,
    build_data,
    pack,
    store,
    tokenize_corpus,
    tokenizers,
)
from diloco.data import documents as docs
from diloco.errors import FieldError

TEXT = "To be, or not to be: that is the question.\nWhether 'tis nobler — in the mind — to suffer\n" * 40


def corpus(tmp_path: Path, text: str = TEXT, name: str = "c.txt") -> Path:
    path = tmp_path / "corpus" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def stream(stored: store.StoredTokens) -> np.ndarray:
    return np.fromfile(stored.path, dtype=stored.dtype)


def test_a_corpus_read_in_pieces_gives_the_tokens_of_a_whole_read(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Pieces of 50 bytes cut at line ends, or inside a long line before a character of several bytes; CRLF read as
    LF: the ids are those of the file read whole in text mode, then EOS."""
    monkeypatch.setattr(docs, "PIECE_BYTES", 50)
    text = "short line\r\n" + "é" * 70 + "\nend — ✓ " + "𝄞" * 30
    path = corpus(tmp_path, text)
    path.write_bytes(text.encode("utf-8"))  # (no newline translation on the way in)
    pieces = list(docs.pieces(path))
    assert len(pieces) > 4 and [p.ends for p in pieces].count(True) == 1 and pieces[-1].ends
    assert sum(p.nbytes for p in pieces) == path.stat().st_size
    whole = path.read_text(encoding="utf-8", errors="replace")  # text mode: "\r\n" becomes "\n"
    assert "".join(p.text for p in pieces) == whole and "\ufffd" not in whole
    stored = store.open_store(path, None, ByteTokenizer(), tmp_path / "cache")
    assert stream(stored).tolist() == list(whole.encode()) + [ByteTokenizer.eos_token_id]
    assert stored.dtype == np.uint16 and stored.documents == 1


def test_a_store_is_built_once_and_reused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = corpus(tmp_path)
    root = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="diloco.data"):
        first = store.open_store(path, None, ByteTokenizer(), root)
    assert "tokeniz" not in caplog.text  # a build of seconds says nothing; its figures are in its manifest
    manifest = json.loads((first.path.parent / "manifest.json").read_text())
    assert manifest["tokens"] == 3721 and manifest["source_bytes"] == path.stat().st_size  # bytes and EOS
    assert 0 < manifest["build_seconds"] < 60
    built_at = first.path.stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="diloco.data"):
        again = store.open_store(path, None, ByteTokenizer(), root)
    assert again == first and again.path.stat().st_mtime_ns == built_at and "tokeniz" not in caplog.text
    assert np.array_equal(stream(first), tokenize_corpus(path, ByteTokenizer()))
    assert [p.name for p in root.iterdir() if p.is_dir()] == [first.path.parent.name]  # nothing left of the build


def test_the_key_follows_the_corpus_and_the_tokenizer(tmp_path: Path) -> None:
    path = corpus(tmp_path)
    before = store.store_key(path, None, ByteTokenizer())
    assert store.store_key(path, None, ByteTokenizer()) == before
    path.write_text(TEXT + "more\n", encoding="utf-8")
    assert store.store_key(path, None, ByteTokenizer()) != before

    class Other(ByteTokenizer):
        fingerprint = "bytes-other"

    assert store.store_key(path, None, Other()) != store.store_key(path, None, ByteTokenizer())


@pytest.mark.parametrize("damage", ["truncated", "a flipped byte", "no manifest"])
def test_a_damaged_store_is_rebuilt_with_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                  damage: str) -> None:  # fmt: skip
    path = corpus(tmp_path)
    stored = store.open_store(path, None, ByteTokenizer(), tmp_path / "cache")
    expected = stream(stored)
    data = bytearray(stored.path.read_bytes())
    if damage == "truncated":
        stored.path.write_bytes(data[: len(data) // 2])
    elif damage == "a flipped byte":
        data[len(data) // 3] ^= 0xFF
        stored.path.write_bytes(data)
    else:
        (stored.path.parent / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="diloco.data"):
        rebuilt = store.open_store(path, None, ByteTokenizer(), tmp_path / "cache")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "is damaged" in warned[0] and "building it again" in warned[0], warned
    assert np.array_equal(stream(rebuilt), expected)


def test_a_store_of_another_tokenizer_is_refused_naming_the_flags(tmp_path: Path) -> None:
    path = corpus(tmp_path)
    stored = store.open_store(path, None, ByteTokenizer(), tmp_path / "cache")
    manifest = stored.path.parent / "manifest.json"
    manifest.write_text(json.dumps(json.loads(manifest.read_text()) | {"tokenizer": "hf-0123456789abcdef"}))
    with pytest.raises(FieldError, match="a token store of another tokenizer") as refused:
        store.open_store(path, None, ByteTokenizer(), tmp_path / "cache")
    assert refused.value.fields == ["token_cache", "tokenizer"]
    assert manifest.exists() and stored.path.exists()  # nothing removed


def test_a_file_that_is_not_text_and_a_cache_that_cannot_be_made_are_one_line_each(tmp_path: Path) -> None:
    binary = tmp_path / "weights.txt"
    binary.write_bytes(b"PK\x03\x04\x00\x00binary")
    with pytest.raises(FieldError, match=r"weights.txt: not a text file \(a NUL byte at offset 4\)") as bad:
        store.open_store(binary, None, ByteTokenizer(), tmp_path / "cache")
    assert bad.value.fields == ["dataset"]
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(FieldError, match="cannot create the token store there") as unmade:
        store.open_store(corpus(tmp_path), None, ByteTokenizer(), blocker / "tokens")
    assert unmade.value.fields == ["token_cache"]


def test_a_build_cut_short_leaves_no_store(tmp_path: Path) -> None:
    class Failing(ByteTokenizer):
        def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
            raise KeyboardInterrupt

    root = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        store.open_store(corpus(tmp_path), None, Failing(), root)
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []


def test_of_two_builders_at_once_one_builds_and_the_other_waits(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """Two threads open the lock file each (flock excludes open files, in one process or two): one tokenizes, the
    other says it waits, then opens the store built."""
    builds: list[int] = []

    class Slow(ByteTokenizer):
        def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
            builds.append(threading.get_ident())
            time.sleep(0.5)
            return super().encode_batch(texts)

    path, root, got = corpus(tmp_path), tmp_path / "cache", []
    threads = [threading.Thread(target=lambda: got.append(store.open_store(path, None, Slow(), root)))
               for _ in range(2)]  # fmt: skip
    with caplog.at_level(logging.DEBUG, logger="diloco.data"):  # (its own level: `console.setup_logging`)
        for thread in threads:
            thread.start()
            time.sleep(0.1)
        for thread in threads:
            thread.join(30)
    assert len(got) == 2 and got[0] == got[1] and len(set(builds)) == 1, (got, builds)
    assert "waiting for another process to tokenize c.txt" in caplog.text


def test_stored_blocks_read_what_packing_in_memory_gives(tmp_path: Path) -> None:
    path = corpus(tmp_path)
    stored = store.open_store(path, None, ByteTokenizer(), tmp_path / "cache")
    train, held_out = stored.blocks(16, 0.1)
    in_memory = pack(tokenize_corpus(path, ByteTokenizer()), 16)
    assert (len(train), len(held_out)) == (len(in_memory[0]), len(in_memory[1]))
    assert np.array_equal(train[np.arange(len(train))], in_memory[0])
    assert np.array_equal(held_out[np.array([0, len(held_out) - 1])], in_memory[1][[0, -1]])
    part = Shard(1, 3).take(train)
    assert np.array_equal(part[np.array([2, 0])], Shard(1, 3).take(in_memory[0])[[2, 0]])
    with pytest.raises(IndexError):
        part[np.array([len(part)])]
    # the same batches, epoch after epoch, from the store as from memory
    a, b = BlockBatches(train, Shard(0, 2), 3, seed=5), BlockBatches(in_memory[0], Shard(0, 2), 3, seed=5)
    for _ in range(2 * a.batches_per_epoch + 1):
        assert torch.equal(a.next_batch(), b.next_batch())


def test_a_run_reads_its_data_through_the_store(tmp_path: Path) -> None:
    path = corpus(tmp_path)
    root = tmp_path / "cache"
    made = build_data(dataset=path, tokenizer_spec=None, vocab_size=300, seq_length=16, batch_size=2, eval_steps=2,
                      seed=0, shard=Shard(0, 1), eval_shard=Shard(0, 1), token_cache=root)  # fmt: skip
    assert "token store " in made.about and len(made.eval_batches) == 2
    assert all(batch.shape == (2, 16) and batch.dtype == torch.int64 for batch in made.eval_batches)
    held_out = pack(tokenize_corpus(path, ByteTokenizer()), 16)[1]
    assert torch.equal(torch.cat(made.eval_batches), torch.from_numpy(held_out[:4].astype(np.int64)))
    assert len([p for p in root.iterdir() if p.is_dir()]) == 1


@pytest.mark.parametrize("text", ["", "short", "x" * 10_000, "ab\n\n\ncd " * 3000, "line one\nline two\n" * 2000])
def test_texts_are_cut_into_parts_at_line_starts_and_nothing_is_lost(text: str) -> None:
    """A fast tokenizer gets parts of about 4 KB: cut after a line end that a visible character follows, else after a
    space, else anywhere; the parts put together are the text."""
    cut = tokenizers.parts(text, size=4096)
    assert "".join(cut) == text and all(len(part) <= 4096 for part in cut[:-1])
    assert all(part.endswith("\n") and not cut[i + 1][:1].isspace() for i, part in enumerate(cut[:-1])
               if "\n" in text)  # fmt: skip

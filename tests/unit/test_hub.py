"""Hub ids (`org/name`) for --path-model, --tokenizer and --dataset, resolved in process through a Hugging Face cache
built here (``tests.support.hub_cache``), offline."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.hub_cache import (
    cache_dataset,
    cache_dataset_configs,
    cache_model,
    cache_tokenizer,
    snapshot,
)


def test_cached_ids_resolve_to_their_snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process (huggingface_hub reads HF_HOME once, at import: the cache root is patched instead)."""
    from diloco import hub
    from diloco.data import HFTokenizer, tokenize_corpus
    from diloco.model import load_model, params_sha256

    monkeypatch.setattr(hub, "hub_cache", lambda: tmp_path / "hf" / "hub")
    saved = cache_model(tmp_path / "hf", "tiny-org/llama", weights=True)
    cache_tokenizer(tmp_path / "hf", "tiny-org/words")
    cache_dataset(tmp_path / "hf", "tiny-org/hamlet")
    assert params_sha256(list(load_model("tiny-org/llama", seed=0).named_parameters())) == saved
    tokens = tokenize_corpus(Path("tiny-org/hamlet"), HFTokenizer("tiny-org/words"))
    assert len(tokens) == 200 * 23  # 22 words and EOS per document


def test_a_snapshot_being_downloaded_is_read_once_the_download_ends(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A groupmate on this machine downloads the tokenizer: its snapshot folder is there, still without files, and
    the other rank waits for the download (the lock) instead of reading a half-written folder."""
    import threading

    from diloco import hub
    from diloco.data import HFTokenizer

    monkeypatch.setattr(hub, "hub_cache", lambda: tmp_path / "hf" / "hub")
    partial = snapshot(tmp_path / "hf", "model", "tiny-org/words")  # refs/main and an empty folder, as at the start
    downloading, done = threading.Event(), threading.Event()

    def groupmate() -> None:
        with hub.download_lock("tiny-org/words"):
            downloading.set()
            done.wait(30)
            shutil.rmtree(partial.parent.parent)  # the download ends: the snapshot, whole
            cache_tokenizer(tmp_path / "hf", "tiny-org/words")

    thread = threading.Thread(target=groupmate)
    thread.start()
    assert downloading.wait(30)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(HFTokenizer("tiny-org/words")))
    reader.start()
    reader.join(1.0)
    waited = reader.is_alive() and not got  # still waiting on the lock, not failed on an empty folder
    done.set()
    thread.join(30)
    reader.join(30)
    assert waited and len(got) == 1 and got[0].inner.eos_token == "</s>"


def test_a_hub_dataset_configuration_is_its_subfolder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--dataset ID --dataset-config NAME`, as seed 003's load_dataset('wikitext', 'wikitext-2-raw-v1')."""
    from diloco import hub
    from diloco.data import HFTokenizer, tokenize_corpus
    from diloco.errors import FieldError

    monkeypatch.setattr(hub, "hub_cache", lambda: tmp_path / "hf" / "hub")
    cache_tokenizer(tmp_path / "hf", "tiny-org/words")
    cache_dataset_configs(tmp_path / "hf", "tiny-org/wiki")
    tokens = tokenize_corpus(Path("tiny-org/wiki"), HFTokenizer("tiny-org/words"), "small")
    assert len(tokens) == 50 * 23
    with pytest.raises(FieldError, match="tiny-org/wiki: no 'text' column \\(columns: words\\)"):
        tokenize_corpus(Path("tiny-org/wiki"), HFTokenizer("tiny-org/words"), "other")


def test_a_local_folder_keeps_priority_over_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco import hub

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not hub.is_hub_id("org/name")
    assert hub.is_hub_id("org/other") and hub.is_hub_id("gpt2")
    assert not hub.is_hub_id("/abs/path") and not hub.is_hub_id("a/b/c") and not hub.is_hub_id("corpus.txt")

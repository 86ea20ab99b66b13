"""Names of models, tokenizers and datasets: a local path first, else a Hugging Face hub id read through the cache.

Seeds name their inputs by hub id (``gpt2``, ``meta-llama/Llama-2-7b-hf``, ``wikitext``). An id resolves to its
snapshot folder in the hub cache (``HF_HOME`` / ``HF_HUB_CACHE``), so the rest of diloco only ever reads local
folders. Only when the id is not cached and the hub is not switched off (``HF_HUB_OFFLINE=1``) is anything
downloaded. Torch-free, and huggingface_hub is imported lazily: the command line checks names before torch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import socket
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from diloco.errors import FieldError, first_line

RepoType = Literal["model", "dataset"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # `gpt2` or `org/name`
MODEL_FILES = ["config.json", "generation_config.json"]
TOKENIZER_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken"]  # vocabularies, merges, sentencepiece models
# one weight format per model, the first the repository has: many hold both, and a second copy doubles the download
WEIGHT_FILES = (["*.safetensors", "*.safetensors.index.json"], ["pytorch_model*.bin", "pytorch_model*.bin.index.json"])
FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")  # a missing `corpus.txt` is a missing file, not an id
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def is_hub_id(name: str) -> bool:
    """An existing path is a path; anything else shaped like `name` or `org/name` is a hub id."""
    path = Path(name)
    return not path.exists() and path.suffix not in FILE_SUFFIXES and HUB_ID.match(name) is not None


def hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def datasets_cache() -> Path:
    """Where `datasets` keeps prepared (arrow) datasets: ``HF_DATASETS_CACHE``, else ``$HF_HOME/datasets``."""
    from huggingface_hub import constants

    return Path(os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets").expanduser()


def offline(repo_type: RepoType = "model") -> bool:
    from huggingface_hub import constants

    dataset_offline = os.environ.get("HF_DATASETS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    return constants.HF_HUB_OFFLINE or (repo_type == "dataset" and dataset_offline)


def cached_snapshot(repo_id: str, repo_type: RepoType = "model") -> Path | None:
    """The snapshot folder of `repo_id` in the hub cache: the commit `refs/main` names, else the newest one."""
    repo = hub_cache() / f"{repo_type}s--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        return snapshot if snapshot.is_dir() else None
    snapshots = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime) if repo.is_dir() else []
    return snapshots[-1] if snapshots else None


def in_datasets_cache(dataset_id: str) -> bool:
    """`datasets` prepared this id before (``<org>___<name>/<config>/<version>/<hash>``, the name in snake case as
    `datasets.naming` spells it): `load_dataset(ID)` reads that offline."""
    *org, name = dataset_id.split("/")
    name = re.sub(r"([a-z\d])([A-Z])", r"\1_\2", re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)).lower()
    return any((datasets_cache() / "___".join([*org, name])).glob("*/*/*"))


def not_found(field: str, name: str, why: str = "") -> FieldError:
    """The one line for an id nobody has: where we looked and how to get it."""
    kind = "--repo-type dataset " if field == "dataset" else ""
    reason = why or ("offline: HF_HUB_OFFLINE=1" if offline("dataset" if field == "dataset" else "model") else "")
    return FieldError(
        f"{{{field}}} {name}: not a local path, and not in the Hugging Face cache {hub_cache()}"
        f"{f' ({reason})' if reason else ''}; download it with `hf download {kind}{name}` on a machine with "
        "internet, or set HF_HOME (or HF_HUB_CACHE) to a cache that has it"
    )


def check_name(field: str, name: str, repo_type: RepoType = "model") -> None:
    """Fail in seconds, before torch, on an id that is not cached while the hub is switched off or unreachable;
    a cached id or a local path costs no network at all."""
    if not is_hub_id(name) or cached_snapshot(name, repo_type) is not None:
        return
    if repo_type == "dataset" and in_datasets_cache(name):
        return
    if offline(repo_type):
        raise not_found(field, name)
    if (why := unreachable()) is not None:
        raise not_found(field, name, why)


@functools.cache
def unreachable(timeout_s: float = 3.0) -> str | None:
    """Why the hub (``HF_ENDPOINT``) cannot be reached, None when it can: one connection attempt, so an offline
    machine fails in seconds, not after huggingface_hub's half a minute of retries. Behind a proxy a direct
    connection proves nothing, so then the download itself tells."""
    from huggingface_hub import constants

    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return None

    url = urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
    except OSError as e:
        return f"the hub {url.hostname} is unreachable: {first_line(e)}"
    return None


@contextlib.contextmanager
def download_lock(name: str, repo_type: RepoType = "model") -> Iterator[None]:
    """Hold this machine's lock on hub id `name`: the ranks and worker groups of one machine share one cache, and
    the first to need an id downloads it while the others wait. A snapshot folder appears with its first file, long
    before its last, so whoever looks for one does so under the lock too. A cache this user cannot write holds no
    lock (and nobody downloads into it from here)."""
    from filelock import FileLock

    lock = hub_cache() / ".locks" / f"diloco--{repo_type}--{name.replace('/', '--')}.lock"
    held: FileLock | None = FileLock(str(lock))
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        held.acquire()
    except OSError:
        held = None
    try:
        yield
    finally:
        if held is not None:
            held.release()


def local_folder(field: str, name: str, patterns: list[str]) -> Path:
    """`name` as a local folder: the path itself, the cached snapshot, or (online) a fresh download of the files
    matching `patterns` (plus the first weight format the repository has, for a model)."""
    if not is_hub_id(name):
        return Path(name)
    with download_lock(name):
        if (snapshot := cached_snapshot(name)) is not None:
            return snapshot
        if offline():
            raise not_found(field, name)
        return _download(field, name, patterns)


def _download(field: str, name: str, patterns: list[str]) -> Path:
    """Download (under ``download_lock``, held by the caller)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        if field == "path_model":
            files = HfApi().list_repo_files(name)
            patterns = patterns + next((p for p in WEIGHT_FILES if _matches(files, p[0])), [])
        return Path(snapshot_download(name, allow_patterns=patterns))
    except RepositoryNotFoundError:
        raise FieldError(
            f"{{{field}}} {name}: not a local path, and no such repository on the Hugging Face hub (a gated one "
            "needs `hf auth login` first)"
        ) from None
    except Exception as e:  # httpx, OSError and huggingface_hub raise their own types for an unreachable hub
        raise not_found(field, name, f"could not download it: {first_line(e)}") from None


def _matches(files: list[str], pattern: str) -> bool:
    return any(fnmatch(file, pattern) for file in files)

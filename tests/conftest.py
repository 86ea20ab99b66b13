"""Fixtures shared by the tests of every tier; the helpers they call live in ``tests/support``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.dht import bootstrap_dht
from tests.support.swarm import diloco_dht

if TYPE_CHECKING:
    import hivemind


@pytest.fixture(autouse=True, scope="session")
def token_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Token stores (``diloco.data.store``) go to a folder of the session's, for the trainers it starts too: a run
    of the suite leaves none in the user's cache."""
    folder = tmp_path_factory.mktemp("xdg-cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(folder))
    yield folder
    patch.undo()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def one_process_group() -> Iterator[None]:
    """A gloo process group of this process alone, as `python -m diloco.train` starts one."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with weights in its folder (a base a user would bring), so that peft reloads onto it."""
    from diloco.model import load_model
    from tests.support.paths import TINY_MODEL

    folder = tmp_path_factory.mktemp("base") / "base"
    load_model(TINY_MODEL, seed=0).save_pretrained(folder)
    return folder


@pytest.fixture
def dht_peer(tmp_path: Path) -> Iterator[list[str]]:
    """`diloco dht` on loopback; yields its --hv.initial-peers multiaddrs; stops it with SIGINT."""
    with diloco_dht(tmp_path / "keys" / "id.pem") as peers:
        yield peers


@pytest.fixture
def bootstrap() -> Iterator[hivemind.DHT]:
    """A DHT peer in this process on 127.0.0.1 that starts a new swarm."""
    with bootstrap_dht() as dht:
        yield dht

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


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


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

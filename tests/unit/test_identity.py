"""A DHT peer's identity file (``diloco.swarm.records.identity``) refused or warned about before any DHT starts;
the peer ids real DHTs take from it are tests/integration/test_swarm.py's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from diloco.swarm.records.dht import start_dht
from diloco.swarm.records.identity import ensure_identity
from tests.support.dht import LOCAL


def test_corrupt_or_unreadable_identity_raises(tmp_path: Path):
    corrupt = tmp_path / "corrupt.key"
    corrupt.write_bytes(b"\x08\x00\x12\x05hello")  # a protobuf PrivateKey whose RSA data is garbage
    corrupt.chmod(0o600)
    with pytest.raises(ValueError, match=re.escape(str(corrupt))) as info:
        ensure_identity(corrupt)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="not a valid"):
        start_dht(initial_peers=[], host_maddrs=LOCAL, announce_maddrs=[], identity_path=corrupt)

    folder = tmp_path / "folder.key"
    folder.mkdir()
    with pytest.raises(ValueError, match="cannot read identity file"):
        ensure_identity(folder)


def test_loose_identity_permissions_warn(tmp_path: Path):
    path = ensure_identity(tmp_path / "peer.key")
    path.chmod(0o644)
    with pytest.warns(UserWarning, match="chmod 600"):
        ensure_identity(path)

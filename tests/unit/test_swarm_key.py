"""The swarm key on its own: the key file, sealed DHT records, signed announcements, keyed state downloads."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch

from diloco.errors import FieldError, UsageError
from diloco.swarm.records import progress, status
from diloco.swarm.records.swarm_key import SealedStore, SwarmKey, keygen
from diloco.swarm.rounds import transfer
from diloco.swarm.rounds.layout import Shape, group_layout
from diloco.swarm.rounds.listener import Listener, listen_socket
from tests.support.records import FakeDHT, owned, record
from tests.support.wiretap import Wiretap

torch.set_num_threads(1)


def key_file(tmp_path: Path, name: str = "swarm.key") -> Path:
    path = tmp_path / name
    keygen(path)
    return path


def test_keygen_writes_a_private_key_and_never_overwrites_one(tmp_path: Path) -> None:
    path = key_file(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text().strip()) == 64
    before = path.read_text()
    with pytest.raises(UsageError, match="exists: not overwriting"):
        keygen(path)
    assert path.read_text() == before
    assert SwarmKey.load(path).tag != SwarmKey.load(key_file(tmp_path, "other.key")).tag


@pytest.mark.parametrize("problem", ["missing", "readable by others", "not a key"])
def test_a_bad_key_file_is_refused_naming_the_flag(tmp_path: Path, problem: str) -> None:
    path = key_file(tmp_path)
    if problem == "missing":
        path = tmp_path / "none.key"
    elif problem == "readable by others":
        path.chmod(0o644)
    else:
        path.write_text("hello\n")
    with pytest.raises(FieldError) as refused:
        SwarmKey.load(path)
    assert refused.value.fields == ["swarm_key"] and str(path) in refused.value.message


def test_records_are_sealed_and_forged_or_foreign_ones_ignored(tmp_path: Path) -> None:
    """A record sealed with the key reads back as it was; one without a seal, with another key's, altered after
    sealing, or replayed with a later expiry than it was sealed with, is dropped and counted."""
    dht = FakeDHT()
    mine, theirs = SealedStore(dht, SwarmKey.load(key_file(tmp_path))), SealedStore(dht, SwarmKey.load(
        key_file(tmp_path, "b.key")))  # fmt: skip
    key = status.status_key("run")
    status.publish(mine, key, record(0), owned(0))
    status.publish(theirs, key, record(1), owned(1))  # another swarm's key
    status.publish(dht, key, record(2), owned(2))  # no key at all
    assert status.read(mine, key) == [record(0)]
    assert mine.rejected == {(key, owned(1)): 1, (key, owned(2)): 1}
    sealed = dht.values[key][owned(0)]
    forged = dict(sealed.value, step=10**6)  # a huge step claimed under a copied seal
    dht.store(key, forged, sealed.expiration_time, subkey=owned(0))
    assert status.read(mine, key) == []
    # a replay that would outlive newer ones
    dht.store(key, sealed.value, sealed.expiration_time + 3600, subkey=owned(0))
    assert status.read(mine, key) == []
    dht.store(key, sealed.value, sealed.expiration_time, subkey=owned(0))
    assert status.read(mine, key) == [record(0)]
    moved = progress.progress_key("run")  # a seal binds the record to its DHT key and subkey
    dht.store(moved, sealed.value, sealed.expiration_time, subkey=owned(0))
    assert progress.read(mine, moved) == []


def test_announcements_and_round_secrets_need_the_key(tmp_path: Path) -> None:
    key, other = SwarmKey.load(key_file(tmp_path)), SwarmKey.load(key_file(tmp_path, "b.key"))
    entry = {"shape": ["FULL_SHARD", 1, 1], "endpoints": [[["127.0.0.1"], 5]], "weight": 1.0}
    assert key.member_signed(key.sign_member(entry)) == entry
    assert key.member_signed(other.sign_member(entry)) is None and key.member_signed(entry) is None
    assert key.member_signed(dict(key.sign_member(entry), weight=50.0)) is None
    assert key.round_secret(b"group") != other.round_secret(b"group") != b"group"
    assert key.run_id("run") == key.run_id("run") != other.run_id("run")


def serve_state(key: SwarmKey | None) -> tuple[Listener, tuple[list[str], int], list[torch.Tensor]]:
    shapes = [(3, 4), (5,)]
    layout = group_layout(shapes, Shape("FULL_SHARD", 1))[0]
    state = [torch.arange(17, dtype=torch.float32), torch.ones(17)]
    service = transfer.StateService(layout, lambda: ({"outer_step": 3}, [t.clone() for t in state]), 5.0, key)
    listener = Listener(listen_socket("127.0.0.1", 0), 5.0).start()
    listener.serve(service.magic, service)
    return listener, (["127.0.0.1"], listener._sock.getsockname()[1]), state


def test_a_keyed_state_download_works_only_between_holders_of_the_key(tmp_path: Path) -> None:
    key, other = SwarmKey.load(key_file(tmp_path)), SwarmKey.load(key_file(tmp_path, "b.key"))
    layout = group_layout([(3, 4), (5,)], Shape("FULL_SHARD", 1))
    listener, endpoint, state = serve_state(key)
    try:
        got = transfer.download(layout[0], layout, [endpoint], 5.0, key=key)
        assert got is not None and got[0] == {"outer_step": 3} and all(map(torch.equal, got[1], state))
        assert transfer.download(layout[0], layout, [endpoint], 2.0, key=other) is None
        assert transfer.download(layout[0], layout, [endpoint], 2.0) is None  # an open swarm's request
    finally:
        listener.close()
    listener, endpoint, _ = serve_state(None)  # an open group cannot pass for a keyed one
    try:
        assert transfer.download(layout[0], layout, [endpoint], 2.0, key=key) is None
    finally:
        listener.close()


def probes(tensor: torch.Tensor) -> list[bytes]:
    """32 bytes from each MiB of `tensor`'s memory."""
    flat = tensor.reshape(-1)
    return [flat[at : at + 8].numpy().tobytes() for at in range(0, flat.numel() - 8, 2**18)]


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "keyed"])
def test_a_keyed_state_download_hides_the_state_and_refuses_a_bit_altered_on_the_path(
    tmp_path: Path, keyed: bool
) -> None:
    """A state of 2 x 2.4 MB downloaded through a wiretap. Open, its values cross as they are, and a bit flipped on
    the way comes through (only the caller's digest check would catch it); keyed, no 32 bytes of them cross, and
    the flipped bit makes the download refused."""
    key = SwarmKey.load(key_file(tmp_path)) if keyed else None
    shapes = [(600, 1000)]
    layout = group_layout(shapes, Shape("FULL_SHARD", 1))
    state = [torch.randn(600_000), torch.randn(600_000)]
    service = transfer.StateService(layout[0], lambda: ({"outer_step": 3}, [t.clone() for t in state]), 5.0, key)
    listener = Listener(listen_socket("127.0.0.1", 0), 5.0).start()
    listener.serve(service.magic, service)
    taps = [Wiretap(), Wiretap(flip_back_at=3_000_000)]  # within the momentum's values
    try:
        for tap in taps:
            endpoint = (["127.0.0.1"], tap.relay(listener._sock.getsockname()[1]))
            refused: list[str] = []
            got = transfer.download(layout[0], layout, [endpoint], 5.0, key=key, refused=refused.append)
            seen = bytes(tap.seen)
            if tap.flip_back_at is None:
                assert got is not None and all(map(torch.equal, got[1], state)), refused
                assert len(seen) > 2 * 4 * 600_000
                crossed = [probe in seen for t in state for probe in probes(t)]
                assert len(crossed) == 6 and set(crossed) == {not keyed}
            elif keyed:
                assert got is None and len(refused) == 1 and "seal" in refused[0], refused
            else:
                assert got is not None and torch.equal(got[1][0], state[0]) and not torch.equal(got[1][1], state[1])
    finally:
        for tap in taps:
            tap.close()
        listener.close()


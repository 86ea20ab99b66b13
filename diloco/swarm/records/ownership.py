"""Owned records: the DHT records a worker group keeps per world rank, which only that group can change.

A group's progress, status and token records sit under a subkey that names the group's own RSA public key
(``<world rank>[owner:ssh-rsa ...]``, hivemind's notation). Every DHT peer this package starts (the trainers' and
``diloco dht``) carries hivemind's ``RSASignatureValidator``: it refuses to store, and drops from the answers it
gets, a record under such a subkey unless the key's owner signed it (the signature covers the key, subkey, value
and expiry, so neither an altered record nor an old one with a later expiry passes). Readers here ignore records
whose subkey names no owner. So in an open swarm a stranger can add records of its own, claiming any world rank,
but can neither replace nor alter another group's.

A group's key lives in its run folder (``owner.key``, DER, mode 0600), so a group resumed from its checkpoint keeps its
records; a group started in a new folder gets a new key (its predecessor's records, if any, expire).

hivemind 1.1.12 is pinned; this module relies on ``RSAPrivateKey._private_key`` (a loaded key file). Reading
records (``owned_entries``) costs no hivemind import.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from diloco.errors import UsageError

if TYPE_CHECKING:
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils.crypto import RSAPrivateKey

KEY_FILE = "owner.key"
# a world rank (at most 18 digits: int() refuses a string of thousands), then hivemind's owner marker
_OWNED = re.compile(r"^([0-9]{1,18})(\[owner:[^\]]+\])$")


class Owner:
    """The key that signs this group's records: its validator (for the DHT peer that stores them), its subkeys."""

    def __init__(self, key: RSAPrivateKey) -> None:
        from hivemind.dht.crypto import RSASignatureValidator

        self.validator = RSASignatureValidator(key)
        self.marker = self.validator.local_public_key.decode()
        self.id = owner_id(self.marker)

    @classmethod
    def load(cls, path: Path) -> Owner:
        """The key in `path`, or a new one when there is none yet (`save` writes it once the group holds its world
        rank: a group refused at its start writes nothing); a UsageError naming the file when it is no key."""
        from cryptography.hazmat.primitives import serialization
        from hivemind.utils.crypto import RSAPrivateKey

        if not path.exists():
            return cls(RSAPrivateKey())
        try:
            return cls(_loaded(serialization.load_der_private_key(path.read_bytes(), password=None)))
        except OSError as e:
            raise UsageError(f"{path}: cannot read this group's record key: {e.strerror}") from None
        except (ValueError, TypeError) as e:
            raise UsageError(f"{path}: not this group's record key ({e}); remove it to make a new one") from None

    def save(self, path: Path) -> None:
        """Keep the key in `path` (mode 0600, its folder created) unless a key is there already."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return
        except OSError as e:
            raise UsageError(f"{path}: cannot keep this group's record key there: {e.strerror}") from None
        with os.fdopen(fd, "wb") as f:
            f.write(self.validator._private_key.to_bytes())

    @classmethod
    def ephemeral(cls) -> Owner:
        """A new random key: for peers that publish nothing that must survive them."""
        from hivemind.utils.crypto import RSAPrivateKey

        return cls(RSAPrivateKey())

    def subkey(self, world_rank: int) -> str:
        """The subkey of this group's record as world rank `world_rank`."""
        return f"{world_rank}{self.marker}"


def _loaded(key: Any) -> RSAPrivateKey:
    """hivemind's RSA key around a key read from a file (its class only makes new ones)."""
    from hivemind.utils.crypto import RSAPrivateKey

    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)  # __init__ would generate a key only to drop it
    wrapped._private_key = key
    return wrapped


def owner_id(marker: str) -> str:
    """A short name of an owner marker (16 hex digits of its sha256), for logs and comparisons."""
    return hashlib.sha256(marker.encode()).hexdigest()[:16]


def checking_validator() -> RSASignatureValidator:
    """A validator for a DHT peer that signs nothing of its own (``diloco dht``, ``diloco status``, the ranks of a
    group besides its rank 0): it still refuses records whose owner did not sign them."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils.crypto import RSAPrivateKey

    return RSASignatureValidator(RSAPrivateKey.process_wide())


def owned_entries(found: Any) -> Iterator[tuple[str, int, Any]]:
    """(owner id, world rank, value) of each entry of a ``get(key, latest=True)`` answer whose subkey names its world
    rank and an owner; entries without one (a stranger's, or an older version's) are skipped. Signatures were
    checked by the DHT peer that fetched them."""
    if found is None or not isinstance(getattr(found, "value", None), dict):
        return
    for subkey, entry in found.value.items():
        match = _OWNED.match(subkey) if isinstance(subkey, str) else None
        if match is not None:
            yield owner_id(match.group(2)), int(match.group(1)), getattr(entry, "value", None)


R = TypeVar("R")
Refused = Callable[[str, int], None]  # told (owner id, world rank) of an owned entry that is not a valid record


def owned_records(found: Any, parse: Callable[[Any], R | None], refused: Refused | None = None
                  ) -> list[tuple[str, R]]:  # fmt: skip
    """(owner id, record) of each owned entry (``owned_entries``) that `parse` reads as a record of the world rank its
    subkey names. Every other owned entry (a stranger's garbage, a version that writes another form, a record of
    another world rank than its subkey's) is skipped and `refused` is told: reading never raises on what a peer
    stored."""
    records = []
    for owner, world_rank, value in owned_entries(found):
        try:
            record = parse(value)
        except Exception:  # noqa: BLE001 - a parser that did not foresee some input: a refusal, not a crash
            record = None
        if record is not None and getattr(record, "world_rank", None) == world_rank:
            records.append((owner, record))
        elif refused is not None:
            refused(owner, world_rank)
    return records

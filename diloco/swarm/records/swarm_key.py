"""The swarm key: a secret shared by every worker group of a private swarm (``diloco keygen``, ``--hv.swarm-key``).

What it does, everywhere a group meets others:

- **DHT keys.** The run id is suffixed with a tag derived from the key (``SwarmKey.run_id``), so matchmaking,
  progress, status and token records of a keyed swarm sit under keys that nobody without the key can name, and a
  group without it (or with another key) never finds the keyed groups.
- **Records.** Every record a group stores in the DHT carries an HMAC-SHA256 over its DHT key, subkey, expiry and
  value (``SealedStore``); records without a valid one are dropped on reading, counted, and logged once per
  sender. The expiry is under the MAC, so an old record replayed cannot outlive the newer one it would shadow.
- **Rounds.** Groups announce themselves in matchmaking with a MAC (``sign_member``, ``member_signed``), and the
  key of a round's TCP handshake is derived from the round's group id *and* the swarm key (``round_secret``): a
  stranger who slipped into a round can neither send nor receive a part.
- **State downloads.** Request and answer carry MACs (``diloco.swarm.rounds.transfer``); the state's bytes are checked
  against the digest in the authenticated metadata.

What it does not do: encrypt. Over ``--hv.transport tcp`` the averaged bytes and downloaded states travel in the
clear (anyone on the path can read them, not alter them unnoticed past the handshake); ``p2pd`` encrypts every
stream (libp2p's noise). Plain Python, no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import stat
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from diloco.errors import FieldError, UsageError

log = logging.getLogger("diloco")

KEY_BYTES = 32
MAC_FIELD = "mac"
EXPIRY_FIELD = "sealed_until"
EXPIRY_SLACK_S = 1e-3  # an expiry read back from the DHT may differ from the sealed one by float rounding


def keygen(path: Path) -> None:
    """Write a new random key to `path` (hex, mode 0600); never overwrites a file (a UsageError naming it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise UsageError(f"{path} exists: not overwriting a swarm key (remove it first to make a new one)") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot create it ({e.strerror})") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES) + "\n")


class SwarmKey:
    """A loaded swarm key; ``load`` reads one from a file."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < KEY_BYTES:
            raise ValueError(f"a swarm key of {len(secret)} bytes; {KEY_BYTES} needed")
        self._secret = secret

    @classmethod
    def load(cls, path: Path) -> SwarmKey:
        """The key in `path`; a FieldError naming ``swarm_key`` when the file is missing, readable by others than
        its owner, or not a key ``diloco keygen`` wrote."""
        try:
            mode = path.stat().st_mode
            text = path.read_text().strip()
        except OSError as e:
            raise FieldError(f"{{swarm_key}} {path}: {e.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise FieldError(f"{{swarm_key}} {path}: permissions {stat.S_IMODE(mode):04o} let others read the key; "
                             f"chmod 600 {path}")  # fmt: skip
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            secret = b""
        if len(secret) < KEY_BYTES:
            raise FieldError(f"{{swarm_key}} {path}: not a swarm key ({KEY_BYTES * 2} or more hex digits, as "
                             "`diloco keygen` writes)")  # fmt: skip
        return cls(secret)

    def mac(self, purpose: str, *parts: bytes) -> bytes:
        """HMAC-SHA256 of `parts` (each length-prefixed, so no two inputs collide) for one `purpose`."""
        digest = hmac.new(self._secret, purpose.encode() + b"\0", hashlib.sha256)
        for part in parts:
            digest.update(len(part).to_bytes(8, "big") + part)
        return digest.digest()

    def check(self, mac: object, purpose: str, *parts: bytes) -> bool:
        return isinstance(mac, (bytes, str)) and hmac.compare_digest(_bytes(mac), self.mac(purpose, *parts))

    @property
    def tag(self) -> str:
        """A public name of the key (it reveals nothing of it): 12 hex digits."""
        return self.mac("tag").hex()[:12]

    def run_id(self, run_id: str) -> str:
        """The run id every DHT key of a keyed swarm derives from."""
        return f"{run_id}-k{self.tag}"

    def round_secret(self, group_id: bytes) -> bytes:
        """The key of a round's handshakes: only members of the round who hold the swarm key can derive it."""
        return self.mac("round", group_id)

    # ------------------------------------------------------------------ records

    def seal(self, key: str, subkey: str, value: dict[str, Any], expires: float) -> dict[str, Any]:
        sealed = {**value, EXPIRY_FIELD: expires}
        return {**sealed, MAC_FIELD: self.mac("record", key.encode(), subkey.encode(), _canonical(sealed)).hex()}

    def opened(self, key: str, subkey: str, value: Any, expires: float) -> dict[str, Any] | None:
        """The value of a sealed record, without its seal; None when the seal is missing or wrong, or the record
        claims a later expiry than it was sealed with."""
        if not isinstance(value, dict):
            return None
        body = {k: v for k, v in value.items() if k != MAC_FIELD}
        sealed_until = body.get(EXPIRY_FIELD)
        if not isinstance(sealed_until, (int, float)) or expires > sealed_until + EXPIRY_SLACK_S:
            return None
        canonical = _canonical(body)
        mac = value.get(MAC_FIELD)
        if canonical is None or not self.check(mac, "record", key.encode(), subkey.encode(), canonical):
            return None
        return {k: v for k, v in body.items() if k != EXPIRY_FIELD}

    # ------------------------------------------------------------------ matchmaking announcements

    def sign_member(self, entry: dict[str, Any]) -> dict[str, Any]:
        return {**entry, MAC_FIELD: self.mac("member", _canonical(entry)).hex()}

    def member_signed(self, entry: Any) -> dict[str, Any] | None:
        """A group's matchmaking announcement without its MAC; None when it carries no valid one."""
        if not isinstance(entry, dict):
            return None
        body = {k: v for k, v in entry.items() if k != MAC_FIELD}
        canonical = _canonical(body)
        return body if canonical is not None and self.check(entry.get(MAC_FIELD), "member", canonical) else None


def _canonical(value: Any) -> bytes | None:
    """One byte string per value, however the DHT's serializer handed it back (tuples come back as lists); None for
    a value that has none (bytes, keys of mixed types, nesting deeper than Python's recursion limit: what a peer
    without the key may send, whose seal then fails without raising)."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    except (TypeError, ValueError, RecursionError):
        return None


def _bytes(mac: bytes | str) -> bytes:
    if isinstance(mac, bytes):
        return mac
    try:
        return bytes.fromhex(mac)
    except ValueError:
        return b""


class SealedStore:
    """A DHT (``hivemind.DHT``: ``store``, ``get``, everything else passed through) whose records are sealed with
    the swarm key on storing and dropped on reading unless their seal holds. ``rejected`` counts the dropped
    records per (DHT key, subkey); each sender is logged once."""

    def __init__(self, dht: Any, key: SwarmKey) -> None:
        self.dht, self.key = dht, key
        self.rejected: Counter[tuple[str, str]] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dht, name)

    def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None, **kwargs: Any) -> Any:
        sealed = self.key.seal(key, str(subkey), value, expiration_time)
        return self.dht.store(key, subkey=subkey, value=sealed, expiration_time=expiration_time, **kwargs)

    def get(self, key: str, latest: bool = False, return_future: bool = False) -> Any:
        if not return_future:
            return self._opened(key, self.dht.get(key, latest=latest))
        opened: Future = Future()

        def done(found: Future) -> None:
            try:
                opened.set_result(self._opened(key, found.result()))
            except Exception as e:  # noqa: BLE001 - handed to the reader, as the DHT's own future would
                opened.set_exception(e)

        self.dht.get(key, latest=latest, return_future=True).add_done_callback(done)
        return opened

    def _opened(self, key: str, found: Any) -> Any:
        """`found` (a ``get`` answer: a value with expiry whose value maps subkeys to values with expiry) with the
        entries whose seal fails left out."""
        if found is None or not isinstance(found.value, dict):
            return found
        kept = {}
        for subkey, entry in found.value.items():
            expires = getattr(entry, "expiration_time", math.inf)
            value = self.key.opened(key, str(subkey), getattr(entry, "value", None), expires)
            if value is None:
                self._reject(key, str(subkey))
            else:  # what readers use of hivemind's ValueWithExpiration
                kept[subkey] = SimpleNamespace(value=value, expiration_time=expires)
        return SimpleNamespace(value=kept, expiration_time=getattr(found, "expiration_time", None))

    def _reject(self, key: str, subkey: str) -> None:
        self.rejected[key, subkey] += 1
        if self.rejected[key, subkey] == 1:
            log.warning("swarm key: ignoring a record under %s (subkey %s) without a valid seal: a peer without this "
                        "swarm's key, or a forged record", key, subkey)  # fmt: skip

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

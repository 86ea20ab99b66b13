"""The swarm key: a secret shared by every worker group of a private swarm (``diloco keygen``, ``--hv.swarm-key``).

What it does, everywhere a group meets others:

- **DHT keys.** The run id is suffixed with a tag derived from the key (``SwarmKey.run_id``), so matchmaking,
  progress, status and token records of a keyed swarm sit under keys that nobody without the key can name, and a
  group without it (or with another key) never finds the keyed groups.
- **Records.** Every record a group stores in the DHT is stored as its JSON bytes (expiry included) and an
  HMAC-SHA256 over its DHT key, subkey and those bytes (``SealedStore``); the MAC is checked before the bytes are
  parsed, and records without a valid one are dropped on reading, counted, and logged once per sender. The expiry
  is under the MAC, so an old record replayed cannot outlive the newer one it would shadow.
- **Rounds.** Groups announce themselves in matchmaking sealed alike, the MAC binding the announcement to the round
  and to the announcing peer (``sign_member``, ``member_signed``), and the key of a round's TCP handshake is derived
  from the round's group id *and* the swarm key (``round_secret``): a stranger who slipped into a round can neither
  send nor receive a part.
- **State downloads.** The source challenges the request with a nonce of its own and checks its MAC before reading
  more than a header (``diloco.swarm.rounds.transfer``); the state's bytes are checked against the digest its owner
  signed in its progress record.
- **Encryption.** The parts and averages of a round and a downloaded state are sealed with AES-256-GCM under keys
  derived from the swarm key and both ends' nonces (``diloco.swarm.rounds.frames``), over either transport; ``p2pd``
  encrypts every stream besides (libp2p's noise). DHT records and announcements are authenticated, not encrypted:
  their keys name nothing without the swarm key, but a DHT peer of the swarm can read what they say.

Plain Python, no torch.
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
BODY_FIELD = "sealed"
SEALED_FIELDS = {BODY_FIELD, MAC_FIELD}  # a sealed value is exactly these: its JSON bytes and their MAC
EXPIRY_FIELD = "sealed_until"
MAX_SEALED_BYTES = 2**16  # a record or an announcement is a few hundred bytes
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
        """Whether `mac` (bytes, or hex) is the MAC of `parts` for `purpose`; False for anything else."""
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
        """`value` with its expiry, as the bytes the MAC covers and the MAC (``SEALED_FIELDS``)."""
        body = _canonical({**value, EXPIRY_FIELD: expires})
        return {BODY_FIELD: body, MAC_FIELD: self.mac("record", key.encode(), subkey.encode(), body)}

    def opened(self, key: str, subkey: str, value: Any, expires: float) -> dict[str, Any] | None:
        """The value of a sealed record, without its seal; None when the seal is missing or wrong, or the record
        claims a later expiry than it was sealed with. The MAC is checked over the raw bytes before anything is
        parsed, so what a peer without the key stores is never parsed here."""
        body = self._checked(value, "record", key.encode(), subkey.encode())
        if body is None:
            return None
        sealed_until = body.pop(EXPIRY_FIELD, None)
        # (the slack comes off `expires`: a sealed int past float's range compares, where adding overflows)
        if type(sealed_until) not in (int, float) or expires - EXPIRY_SLACK_S > sealed_until:
            return None
        return body

    # ------------------------------------------------------------------ matchmaking announcements

    def sign_member(self, entry: dict[str, Any], *context: bytes) -> dict[str, Any]:
        """A group's announcement, sealed; `context` (the round, the announcing peer) is under the MAC but not in the
        announcement: a reader must give the same to ``member_signed``, so an announcement replayed into another
        round, or by another peer, fails."""
        body = _canonical(entry)
        return {BODY_FIELD: body, MAC_FIELD: self.mac("member", *context, body)}

    def member_signed(self, entry: Any, *context: bytes) -> dict[str, Any] | None:
        """A group's matchmaking announcement without its seal; None when it carries no valid one for `context`."""
        return self._checked(entry, "member", *context)

    def _checked(self, sealed: Any, purpose: str, *context: bytes) -> dict[str, Any] | None:
        """The JSON object under a seal (``seal``, ``sign_member``) whose MAC over `context` and the raw body holds;
        None for anything else (another form, a wrong MAC, a body that is not a JSON object)."""
        if not isinstance(sealed, dict) or set(sealed) != SEALED_FIELDS:
            return None
        body, mac = sealed[BODY_FIELD], sealed[MAC_FIELD]
        if not isinstance(body, bytes) or len(body) > MAX_SEALED_BYTES or not self.check(mac, purpose, *context, body):
            return None
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):  # (a key holder's bug: members seal only what ``_canonical`` wrote)
            return None
        return value if isinstance(value, dict) else None


def _canonical(value: Any) -> bytes:
    """One byte string per value: what a seal covers (tuples and lists alike, keys sorted)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


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

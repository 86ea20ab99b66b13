"""Peer identity: the private key file that gives a DHT peer a stable peer id across restarts.

Files are in hivemind's format: a libp2p ``crypto_pb2.PrivateKey`` protobuf holding an RSA key (DER), the only kind
``PeerID.from_identity`` (and so ``P2P.create(identity_path=...)``) can read. New files get mode 0600; no key is
ever committed (``keys/`` ignores ``*.pem``).
"""

from __future__ import annotations

import os
import stat
import threading
import warnings
from pathlib import Path

from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey


def ensure_identity(path: Path) -> Path:
    """Create the peer's private key file at ``path`` unless it exists, then validate it.

    :param path: key file; parent folders are created, a new file gets mode 0600. Reusing it keeps the peer id
        stable across restarts.
    :returns: ``path``
    :raises ValueError: the file cannot be created, cannot be read or is not a key hivemind can use (one line
        naming the file). A file that group or others can read only warns (``UserWarning``).
    """
    path = Path(path)
    if not path.exists():
        _write_new_identity(path)
    identity_peer_id(path)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        warnings.warn(
            f"identity file {path} is accessible to group/others (mode {mode:o}); run: chmod 600 {path}", stacklevel=2
        )
    return path


def identity_peer_id(path: Path) -> str:
    """Return the base58 peer id of the key stored at ``path``; ``ValueError`` if unreadable or invalid."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read identity file {path}: {e.strerror or e}") from None
    try:
        return PeerID.from_identity(data).to_base58()
    except Exception as e:  # protobuf DecodeError, cryptography ValueError, ...
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"identity file {path} is not a valid libp2p RSA private key: {reason}") from None


def _write_new_identity(path: Path) -> None:
    """Write a new RSA key in hivemind's format, atomically, never replacing a key another process just wrote;
    ``ValueError`` naming the file when it cannot be written."""
    # hivemind 1.1.12 reads identity files only as RSA (PeerID.from_identity uses load_der_private_key), so an
    # Ed25519 key would make P2P.create fail whenever initial_peers are given. Same bytes as P2P.generate_identity.
    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, key.SerializeToString())
    except OSError as e:
        blocker = next((parent for parent in path.parents if parent.exists()), None)
        reason = f"{blocker} is a file, not a folder" if blocker and not blocker.is_dir() else e.strerror or e
        raise ValueError(f"cannot create identity file {path}: {reason}") from None


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` with mode 0600; if ``path`` appeared meanwhile, keep that one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # independent of umask
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if a concurrent rank created the file first: keep theirs
    except FileExistsError:
        pass
    finally:
        tmp.unlink()

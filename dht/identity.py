"""Peer identity: an Ed25519 key whose libp2p peer id names the peer in the DHT and on the wire.

The same key is the peer's libp2p identity, so a multiaddr's `/p2p/<peer id>` part carries the
public key that signs that peer's records (for a coordinator: the run spec).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dht.errors import UserError

logger = logging.getLogger(__name__)

# libp2p protobuf framing of Ed25519 keys: field 1 (KeyType) = 1 (Ed25519), field 2 = key bytes
_PUBLIC_PREFIX = bytes([0x08, 0x01, 0x12, 0x20])
_PRIVATE_PREFIX = bytes([0x08, 0x01, 0x12, 0x40])


class IdentityError(UserError, ValueError):
    """An identity file or peer id that cannot be used; the message says which and why."""


def default_identity_path() -> Path:
    """Where `peer` keeps the user's key unless told otherwise (XDG config directory)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "swarmtrain" / "identity.pem"


def _not_a_directory(path: Path) -> None:
    if path.is_dir():
        raise IdentityError(f"identity {path} is a directory; give the path of a key file (e.g. {path}/identity.pem)")


def _private_to_owner(path: Path) -> None:
    """Like ssh, never use a key others can read: tighten its mode to 0600 (with a warning) or refuse."""
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return  # a missing file is reported by the caller
    if not mode & 0o077:
        return
    try:
        os.chmod(path, 0o600)
    except OSError as e:
        raise IdentityError(
            f"identity file {path} is readable by others (mode {mode:o}) and cannot be made private: {e.strerror}"
        ) from None
    logger.warning("identity file %s was readable by others (mode %o); made it private (600)", path, mode)


def peer_id_from_public_bytes(public: bytes) -> str:
    """The libp2p peer id (base58 identity multihash) of a raw 32-byte Ed25519 public key."""
    proto = _PUBLIC_PREFIX + public
    return base58.b58encode(bytes([0x00, len(proto)]) + proto).decode()


def public_key_from_peer_id(peer_id: str) -> Ed25519PublicKey:
    """Recover the Ed25519 public key embedded in a libp2p peer id; IdentityError if there is none."""
    try:
        raw = base58.b58decode(peer_id)
    except ValueError as e:
        raise IdentityError(f"peer id {peer_id!r} is not base58") from e
    proto_len = len(_PUBLIC_PREFIX) + 32
    if len(raw) != 2 + proto_len or raw[0] != 0x00 or raw[1] != proto_len or not raw[2:].startswith(_PUBLIC_PREFIX):
        raise IdentityError(f"peer id {peer_id!r} does not embed an Ed25519 public key")
    return Ed25519PublicKey.from_public_bytes(raw[2 + len(_PUBLIC_PREFIX) :])


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """Whether `signature` over `data` was made by the key of `peer_id`."""
    try:
        public_key_from_peer_id(peer_id).verify(signature, data)
        return True
    except (IdentityError, InvalidSignature, ValueError):
        return False


class Identity:
    """A peer's Ed25519 private key and the names derived from it."""

    def __init__(self, private_key: Ed25519PrivateKey, path: Path | None = None):
        self.private_key = private_key
        self.path = path
        self.public_bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id = peer_id_from_public_bytes(self.public_bytes)
        self._lock_file = None

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Identity:
        path = Path(path)
        _not_a_directory(path)
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except FileNotFoundError:
            raise IdentityError(f"identity file {path} does not exist") from None
        except PermissionError:
            raise IdentityError(f"identity file {path} cannot be read by this user") from None
        except TypeError:  # cryptography's word for a key that needs a password
            raise IdentityError(f"identity file {path} is encrypted; give an unencrypted Ed25519 key") from None
        except ValueError as e:
            raise IdentityError(f"identity file {path} is not a PEM private key: {e}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"identity file {path} holds a {type(key).__name__}, expected an Ed25519 key")
        _private_to_owner(path)
        return cls(key, path)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike | None = None) -> Identity:
        """Load the key at `path` (default: the user's config directory), creating it on first use."""
        path = Path(path) if path is not None else default_identity_path()
        if not path.exists() and not path.is_symlink():
            return cls.create(path)
        return cls.load(path)

    @classmethod
    def create(cls, path: str | os.PathLike, replace: bool = False) -> Identity:
        """A new key written at `path`; whatever is there (a key, or a broken file) only with `replace`."""
        path = Path(path)
        _not_a_directory(path)
        if path.exists() and not replace:
            try:
                named = f" (peer id {cls.load(path).peer_id})"
            except IdentityError:
                named = " (not a usable key)"
            raise IdentityError(
                f"identity {path} exists already{named}; --force replaces it, and the old peer id is gone for good"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        identity = cls.generate()
        if path.exists():
            Identity(identity.private_key, path).lock()  # refused while a running peer holds this path
            tmp = path.with_name(path.name + ".new")
            tmp.unlink(missing_ok=True)
            identity.save(tmp)
            os.replace(tmp, path)
            identity.path = path
        else:
            identity.save(path)
        return identity

    def save(self, path: str | os.PathLike) -> None:
        """Write the key as unencrypted PKCS#8 PEM, readable by the owner only."""
        path = Path(path)
        pem = self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        self.path = path

    def lock(self) -> None:
        """Hold an exclusive lock on the key file for this process's life: one live peer per identity."""
        if self.path is None or self._lock_file is not None:
            return
        lock_path = str(self.path) + ".lock"
        self._lock_file = open(lock_path, "w")  # noqa: SIM115 - held until the process exits
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise IdentityError(
                f"identity {self.path} is in use by another running peer; give this one its own with --identity PATH"
            ) from None

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    def libp2p_key_bytes(self) -> bytes:
        """The key in libp2p's protobuf format, as the p2p daemon reads it."""
        seed = self.private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        return _PRIVATE_PREFIX + seed + self.public_bytes

    def write_libp2p_key(self) -> str:
        """Write the libp2p form of the key into a fresh private temp file and return its path."""
        directory = tempfile.mkdtemp(prefix="swarmtrain-id-")
        path = os.path.join(directory, "libp2p.key")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.libp2p_key_bytes())
        return path

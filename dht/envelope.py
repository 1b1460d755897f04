"""Signed envelopes: how a record's owner binds its payload to a DHT key, subkey and expiry."""

from __future__ import annotations

import struct

import msgpack

from dht import identity as identity_lib

_DOMAIN = b"swarmtrain-record-v1\x00"


def _message(key_id: bytes, subkey_bytes: bytes, expiration_time: float, payload: bytes) -> bytes:
    return b"".join(
        [
            _DOMAIN,
            struct.pack(">I", len(key_id)),
            key_id,
            struct.pack(">I", len(subkey_bytes)),
            subkey_bytes,
            struct.pack(">d", expiration_time),
            payload,
        ]
    )


def seal(
    identity: identity_lib.Identity,
    key_id: bytes,
    subkey_bytes: bytes,
    expiration_time: float,
    payload: bytes,
    certificate: bytes | None = None,
) -> bytes:
    """Wrap `payload` with the owner's signature over where and until when it is stored.

    `certificate` (DER) is the owner's credential, carried beside the signed part: it is itself
    signed by the run's coordinator and names the owner, so readers can tell an admitted owner.
    """
    signature = identity.sign(_message(key_id, subkey_bytes, expiration_time, payload))
    envelope = {"v": 1, "p": payload, "s": signature}
    if certificate:
        envelope["c"] = certificate
    return msgpack.packb(envelope, use_bin_type=True)


def open_envelope(
    owner_peer_id: str, key_id: bytes, subkey_bytes: bytes, expiration_time: float, value: bytes
) -> bytes | None:
    """The payload if `value` is an envelope signed by `owner_peer_id` for this place, else None."""
    opened = open_sealed(owner_peer_id, key_id, subkey_bytes, expiration_time, value)
    return None if opened is None else opened[0]


def open_sealed(
    owner_peer_id: str, key_id: bytes, subkey_bytes: bytes, expiration_time: float, value: bytes
) -> tuple[bytes, bytes | None] | None:
    """(payload, certificate DER or None) if `value` is an envelope signed by `owner_peer_id`, else None."""
    try:
        envelope = msgpack.unpackb(value, raw=False)
    except Exception:  # untrusted bytes from the DHT: whatever msgpack raises, they are not an envelope of ours
        return None
    if not isinstance(envelope, dict) or envelope.get("v") != 1:
        return None
    payload, signature = envelope.get("p"), envelope.get("s")
    if not isinstance(payload, bytes) or not isinstance(signature, bytes):
        return None
    if not identity_lib.verify(owner_peer_id, _message(key_id, subkey_bytes, expiration_time, payload), signature):
        return None
    certificate = envelope.get("c")
    return payload, certificate if isinstance(certificate, bytes) else None

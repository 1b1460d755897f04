"""Which peers are admitted: credentials checked once and cached, the revocation list, endpoints by peer.

A peer's DHT node holds one `Gate` once it has its own credential. Records then count only when
their owner's envelope carries a valid credential of this run that names the owner and is not
revoked (the coordinator, the run's root of trust, needs none). The gate also remembers which
peer announced which gRPC endpoint, so a caller can pin the TLS name of the peer it means to reach.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

from dht.credential import Credential, CredentialError, RevokedError, read_credential


class Gate:
    def __init__(self, run: str, coordinator: str, cache_size: int = 4096):
        self.run, self.coordinator = run, coordinator
        self.revoked: frozenset[str] = frozenset()
        self.cache_size = cache_size
        self._checked: OrderedDict[bytes, Credential | str] = OrderedDict()  # sha256(cert) -> credential or error
        self._endpoints: OrderedDict[str, str] = OrderedDict()  # endpoint -> peer id that announced it

    def check(self, certificate: bytes | None, owner: str | None = None) -> Credential:
        """The credential a certificate (PEM or DER) proves; CredentialError saying why not.

        With `owner`, the certificate must name that peer.
        """
        if not certificate:
            raise CredentialError("no credential")
        digest = hashlib.sha256(certificate).digest()
        found = self._checked.get(digest)
        if found is None:
            try:
                found = read_credential(certificate, self.coordinator, self.run)
            except CredentialError as e:
                found = str(e)
            self._checked[digest] = found
            while len(self._checked) > self.cache_size:
                self._checked.popitem(last=False)
        else:
            self._checked.move_to_end(digest)
        if isinstance(found, str):
            raise CredentialError(found)
        if time.time() > found.not_after:
            raise CredentialError(f"the credential of {found.peer_id} expired")
        if owner is not None and found.peer_id != owner:
            raise CredentialError(f"the credential names {found.peer_id}, not {owner}")
        if found.peer_id in self.revoked:
            raise RevokedError(f"peer {found.peer_id} was revoked by the run's coordinator")
        return found

    def admits(self, owner: str, certificate: bytes | None) -> bool:
        """Whether a record signed by `owner` and carrying `certificate` counts."""
        if owner == self.coordinator:
            return True
        try:
            self.check(certificate, owner)
        except CredentialError:
            return False
        return True

    def note_endpoint(self, endpoint: str, peer_id: str) -> None:
        self._endpoints[endpoint] = peer_id
        self._endpoints.move_to_end(endpoint)
        while len(self._endpoints) > self.cache_size:
            self._endpoints.popitem(last=False)

    def peer_at(self, endpoint: str) -> str | None:
        """The admitted peer whose newest record announced `endpoint`, if any was read."""
        return self._endpoints.get(endpoint)

"""Which peers are admitted: credentials checked once and cached, and the revocation list.

A peer's DHT node holds one `Gate` once it has its own credential. Records then count only when
their owner's envelope carries a valid credential of this run that names the owner and is not
revoked (the coordinator, the run's root of trust, needs none). Endpoints are not mapped to peers here:
any admitted record may name any endpoint, so a caller pins the owner of the record it chose.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

from dht.credential import Credential, CredentialError, RevokedError, read_credential

ERROR_TTL = 30.0  # s a certificate found invalid stays so without a new check (it may be "not yet valid")
AUTHORITY = frozenset({"authority"})  # what the run's coordinator signs with: it may publish any record


class Gate:
    def __init__(self, run: str, coordinator: str, cache_size: int = 4096):
        self.run, self.coordinator = run, coordinator
        self.revoked: frozenset[str] = frozenset()
        self.cache_size = cache_size
        # sha256(cert) -> credential, or (error, when): an error is checked again after ERROR_TTL (a clock fixed)
        self._checked: OrderedDict[bytes, Credential | tuple[str, float]] = OrderedDict()

    def check(self, certificate: bytes | None, owner: str | None = None) -> Credential:
        """The credential a certificate (PEM or DER) proves; CredentialError saying why not.

        With `owner`, the certificate must name that peer.
        """
        if not certificate:
            raise CredentialError("no credential")
        digest = hashlib.sha256(certificate).digest()
        found = self._checked.get(digest)
        if found is None or (isinstance(found, tuple) and time.monotonic() - found[1] > ERROR_TTL):
            try:
                found = read_credential(certificate, self.coordinator, self.run)
            except CredentialError as e:
                found = (str(e), time.monotonic())
            self._checked[digest] = found
            while len(self._checked) > self.cache_size:
                self._checked.popitem(last=False)
        else:
            self._checked.move_to_end(digest)
        if isinstance(found, tuple):
            raise CredentialError(found[0])
        if time.time() > found.not_after:
            raise CredentialError(f"the credential of {found.peer_id} expired")
        if owner is not None and found.peer_id != owner:
            raise CredentialError(f"the credential names {found.peer_id}, not {owner}")
        if found.peer_id in self.revoked:
            raise RevokedError(f"peer {found.peer_id} was revoked by the run's coordinator")
        return found

    def roles_of(self, owner: str, certificate: bytes | None) -> frozenset[str] | None:
        """The roles a record signed by `owner` and carrying `certificate` speaks with: None if it does not count
        (no valid credential naming `owner`); AUTHORITY for the run's coordinator. One credential check."""
        if owner == self.coordinator:
            return AUTHORITY
        try:
            return frozenset(self.check(certificate, owner).roles)
        except CredentialError:
            return None

    @staticmethod
    def may_publish(roles: frozenset[str] | None, writers: frozenset[str]) -> bool:
        """Whether a record whose signer speaks with `roles` (from `roles_of`) may be one the roles `writers` publish."""
        return roles is AUTHORITY or bool(roles and roles.intersection(writers))

    def may_write(self, owner: str, certificate: bytes | None, writers: frozenset[str]) -> bool:
        """Whether `owner`'s credential has one of the roles `writers` (the coordinator may write anything)."""
        return self.may_publish(self.roles_of(owner, certificate), writers)

    def admits(self, owner: str, certificate: bytes | None) -> bool:
        """Whether a record signed by `owner` and carrying `certificate` counts."""
        return self.roles_of(owner, certificate) is not None

"""This peer's credential: its TLS key, the certificate the coordinator signed for it, renewal, revocations.

A joining peer asks the run's coordinator for a credential through the DHT (peer.coordinator.authority
answers): the request carries a fresh P-256 TLS key, signed by the peer's identity key, and an
invite proof when the run wants one. The answer is a certificate for that key naming the peer id
and its roles, and the run's CA certificate. From then on:
- gRPC servers present the certificate and require one from every caller (mutual TLS, peer.net.guard);
- gRPC channels present it and pin the server's TLS name to the peer its DHT record names;
- DHT records carry it, and records of peers without a valid one do not count (dht.gate);
- a thread renews it at half-life and follows the revocation list every `admission.refresh` s (its own DHT node's
  copy, the network's every `security.revocations_read_period`).

With `admission.mode = "off"` there is no `Security` at all: plaintext gRPC and no checks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from dht import keys
from dht.credential import (
    Credential,
    CredentialError,
    dns_name_of,
    invite_mac,
    ownership_proof,
    tls_key_der,
)
from dht.errors import UserError
from dht.gate import Gate
from dht.identity import Identity, IdentityError, public_key_from_peer_id
from dht.node import SwarmDHT
from dht.records import CredentialGrant, CredentialRequest, RevocationList
from peer.config import PeerConfig, RunSpec
from protocols.failures import Reason, reason_of

logger = logging.getLogger(__name__)
UNKNOWN_PEER_NAME = "unknown-peer.swarmtrain"  # the TLS name pinned when a caller names no peer: no server passes


class AdmissionRefused(UserError, RuntimeError):
    """The coordinator did not admit this peer; the message says why."""


def revocation_periods(spec: RunSpec, cfg: PeerConfig) -> tuple[float, float]:
    """(lifetime, restore period) of the coordinator's revocation list in the DHT. It lives as long as a credential
    at least (admission.credential_ttl): a revoked peer's last credential runs out before the list does, even when
    the coordinator is away meanwhile (a list of security.revocations_ttl once expired while such a credential was
    still valid, and a peer starting then read none). Unchanged, it is stored again every third of
    security.revocations_ttl (at least 4 refreshes), at least half a refresh apart."""
    refresh = spec.admission.refresh
    base = max(cfg.security.revocations_ttl, 4 * refresh)
    return max(base, spec.admission.credential_ttl), max(refresh / 2, base / 3)


def gate_for(spec: RunSpec, coordinator: str, dht: SwarmDHT | None = None) -> Gate | None:
    """A reader's gate for the run (None when admission is off); with `dht`, holding the revocation list now."""
    if spec.admission.mode == "off":
        return None
    gate = Gate(spec.name, coordinator)
    if dht is not None:
        found = dht.get(keys.revocations_key(spec.name), RevocationList, gated=False).get(coordinator)
        gate.revoked = frozenset(found.peers) if found is not None else frozenset()
    return gate


class Security:
    """One process's credential and the TLS credentials made from it.

    `issue` obtains a certificate: for a peer, a request to the coordinator through the DHT; for the
    coordinator itself, its own authority (peer.coordinator.authority).
    """

    def __init__(
        self,
        spec: RunSpec,
        cfg: PeerConfig,
        identity: Identity,
        dht: SwarmDHT,
        coordinator: str,
        roles: tuple[str, ...],
        issue: Callable[[Security], tuple[str, str]] | None = None,
        follows_revocations: bool = True,
    ):
        """`follows_revocations` False: the list is the caller's own (the coordinator's authority sets the gate's)."""
        self.spec, self.cfg, self.identity, self.dht = spec, cfg, identity, dht
        self.follows_revocations = follows_revocations
        self.coordinator, self.roles = coordinator, tuple(roles)
        self.key = ec.generate_private_key(ec.SECP256R1())  # this process's TLS key (never leaves it)
        self.key_pem = self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        self.gate = dht.gate or Gate(spec.name, coordinator)
        dht.gate = self.gate
        self._issue = issue or request_credential
        self.certificate_pem = self.authority_pem = b""
        self.credential: Credential | None = None
        self.generation = 0  # bumped at each new certificate: channels made before are replaced
        self._revocations_due = 0.0  # monotonic: the revocation list is read from the network again after this
        self._revocations_stamp: tuple = ()  # what this node held of the list when its copy was last read
        self._stamp_since = 0.0  # monotonic: when that changed last (the coordinator's store reached this node)
        self._read_at = float("-inf")  # monotonic: the last read of the list from the network
        self._recheck = threading.Event()  # set (with _stop, or by `recheck`): the maintaining thread looks now
        self.on_revoked: Callable[[], None] | None = None  # called once if this peer's own credential is revoked
        self.revoked = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._channel_credentials: tuple[int, grpc.ChannelCredentials] | None = None

    # ---- obtaining and renewing ------------------------------------------------------------
    def obtain(self) -> None:
        """Get a certificate (blocking); AdmissionRefused if the coordinator says no or does not answer."""
        certificate, authority = self._issue(self)
        self.install(certificate.encode(), authority.encode())

    def install(self, certificate_pem: bytes, authority_pem: bytes) -> None:
        try:
            credential = self.gate.check(certificate_pem, self.identity.peer_id)
            ca = x509.load_pem_x509_certificate(authority_pem)
        except (CredentialError, ValueError) as e:
            raise AdmissionRefused(f"the coordinator's answer is not a usable credential: {e}") from None
        raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
        if ca.public_key().public_bytes(*raw) != public_key_from_peer_id(self.coordinator).public_bytes(*raw):
            raise AdmissionRefused("the run's CA certificate is not the coordinator's key")
        der = x509.load_pem_x509_certificate(certificate_pem).public_bytes(serialization.Encoding.DER)
        with self._lock:
            self.certificate_pem, self.authority_pem, self.credential = certificate_pem, authority_pem, credential
            self.generation += 1
        self.dht.certificate = der

    def start(self) -> None:
        """Read the revocation list now (before this peer loads state from anyone or serves), then renew at
        half-life and follow the list, on a thread of its own, until `stop`."""
        try:
            if self.follows_revocations:
                self.refresh_revocations()
        except Exception as e:  # the DHT may be busy: read again within a refresh period
            logger.warning("could not read the revocation list yet: %s", e)
        self._thread = threading.Thread(target=self._maintain, name="security", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._recheck.set()

    def recheck(self) -> None:
        """A peer refused this one's call as not admitted (revoked, it says): read the revocation list from the
        network now, not at the next period (another peer's word is no proof: only the coordinator's list counts),
        at most once a refresh period."""
        self._revocations_due = min(self._revocations_due, self._read_at + self.spec.admission.refresh)
        self._recheck.set()

    def _maintain(self) -> None:
        refresh = self.spec.admission.refresh
        while True:
            self._recheck.wait(refresh)
            self._recheck.clear()
            if self._stop.is_set():
                return
            try:
                if self.follows_revocations:
                    self.refresh_revocations()
            except Exception as e:  # following revocations must not stop: read again next period
                logger.warning("could not read the revocation list: %s", e)
            if self.revoked:
                return
            credential = self.credential
            if credential is None:
                continue
            issued = credential.not_after - self.spec.admission.credential_ttl
            if time.time() < issued + self.spec.admission.credential_ttl / 2:
                continue
            try:
                self.obtain()
                logger.info("renewed this peer's credential (valid until %s)", time.ctime(self.credential.not_after))
            except AdmissionRefused as e:
                logger.error("could not renew this peer's credential: %s", e)
            except Exception as e:  # renewal must not stop: tried again until the credential runs out
                logger.warning("could not renew this peer's credential yet: %s", e)

    def refresh_revocations(self) -> None:
        """Follow the coordinator's revocation list: its copy on this peer's own DHT node while the coordinator keeps
        storing it there (no network), the network's every security.revocations_read_period, and at each refresh
        while the node holds none, or a copy the coordinator has not stored again within its period (the node is no
        longer among the list's nearest: the copy may be stale)."""
        key, now = keys.revocations_key(self.spec.name), time.monotonic()
        found = None
        if now < self._revocations_due:
            stamp = self.dht.local_stamp(key)  # subkeys and expirations only: unchanged, the copy is what we follow
            changed = stamp != self._revocations_stamp
            if changed:
                self._revocations_stamp, self._stamp_since = stamp, now
            if stamp and not changed and now - self._stamp_since < self._restored_within():
                return
            if stamp and changed:
                found = self.dht.local_get(key, RevocationList).get(self.coordinator)
        if found is None:
            self._read_at = time.monotonic()
            found = self.dht.get(key, RevocationList).get(self.coordinator)
            if found is None:
                return
            if now >= self._revocations_due:
                self._revocations_due = time.monotonic() + self.cfg.security.revocations_read_period
        self.gate.revoked = frozenset(found.peers)
        if self.identity.peer_id in self.gate.revoked and not self.revoked:
            self.revoked = True
            logger.error("this peer's credential was revoked by the run's coordinator")
            if self.on_revoked is not None:
                self.on_revoked()

    def refused(self, error: BaseException) -> None:
        """A call of this peer failed: if a peer refused it as not admitted, `recheck` the revocation list."""
        if isinstance(error, grpc.RpcError) and reason_of(error) == Reason.NOT_ADMITTED:
            self.recheck()

    def _restored_within(self) -> float:
        """How long a node among the revocation list's nearest goes without the coordinator storing it again there:
        its restore period (`revocation_periods`, peer.coordinator.authority), plus two refresh periods."""
        return revocation_periods(self.spec, self.cfg)[1] + 2 * self.spec.admission.refresh

    # ---- TLS -------------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS for a gRPC server, picking up renewed certificates for new connections."""
        served = [self.generation]

        def configuration():
            with self._lock:
                return grpc.ssl_server_certificate_configuration(
                    [(self.key_pem, self.certificate_pem)], root_certificates=self.authority_pem
                )

        def fetch():
            if served[0] == self.generation:
                return None
            served[0] = self.generation
            return configuration()

        return grpc.dynamic_ssl_server_credentials(configuration(), fetch, require_client_authentication=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        with self._lock:
            cached = self._channel_credentials
            if cached is None or cached[0] != self.generation:
                creds = grpc.ssl_channel_credentials(self.authority_pem, self.key_pem, self.certificate_pem)
                self._channel_credentials = cached = (self.generation, creds)
            return cached[1]

    def target_name(self, peer_id: str | None) -> str:
        """The TLS name a server must prove to be `peer_id` (the owner of the record a caller chose); with no
        peer, a name no credential carries. Never looked up by endpoint: any admitted record may name any."""
        if not peer_id:
            return UNKNOWN_PEER_NAME
        try:
            return dns_name_of(peer_id)
        except IdentityError:
            return UNKNOWN_PEER_NAME


def request_credential(security: Security) -> tuple[str, str]:
    """Ask the coordinator through the DHT; (certificate PEM, CA PEM). AdmissionRefused with its reason."""
    spec, cfg, identity, dht = security.spec, security.cfg.security, security.identity, security.dht
    nonce = os.urandom(16)
    public = security.key.public_key()
    der = tls_key_der(public)
    request = CredentialRequest(
        tls_key=der.hex(),
        roles=list(security.roles),
        nonce=nonce.hex(),
        proof=ownership_proof(identity, public, nonce).hex(),
    )
    if cfg.invite:
        invite_id, _, secret = cfg.invite.strip().partition(".")
        if not secret:
            raise AdmissionRefused(
                "security.invite: an invite code looks like ID.SECRET (from `peer coordinator invite`)"
            )
        request.invite, request.invite_mac = invite_id, invite_mac(secret, identity.peer_id, der, nonce)
    timeout = cfg.admission_timeout
    deadline, stored = time.monotonic() + timeout, 0.0
    answer_key = keys.credential_key(spec.name, identity.peer_id)
    while time.monotonic() < deadline:
        if time.monotonic() - stored > 5.0:  # again now and then: a DHT node that held it may have gone
            dht.store(keys.credential_requests_key(spec.name), request, ttl=timeout + 5.0)
            stored = time.monotonic()
        grant = dht.get(answer_key, CredentialGrant, gated=False).get(security.coordinator)
        if grant is not None and grant.nonce == request.nonce:
            if grant.error:
                raise AdmissionRefused(f"the coordinator of run '{spec.name}' refused this peer: {grant.error}")
            return grant.certificate, grant.authority
        time.sleep(cfg.poll)
    raise AdmissionRefused(
        f"the coordinator of run '{spec.name}' did not answer this peer's credential request within {timeout:.0f} s "
        "(security.admission_timeout); is it running?"
    )

"""Credentials of admitted peers: X.509 certificates the run's coordinator signs.

The coordinator's Ed25519 identity key is the run's certificate authority. An admitted peer gets a
short-lived leaf certificate for a P-256 TLS key of its own (gRPC's TLS refuses Ed25519 leaves,
see docs/security.md) that names:
- the peer: a URI `swarmtrain://RUN/peer/PEER_ID` (the peer id embeds its Ed25519 key), and a DNS
  name derived from its identity key, which a caller pins as the TLS target name;
- its roles: URIs `swarmtrain://RUN/role/ROLE`;
- the run, and an expiry (renewed at half-life while the peer stays admitted).

Before the coordinator signs, the peer proves it holds its identity key: it signs its TLS public
key and a nonce of the coordinator's with it (`ownership_proof`). Nothing here touches the network.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID

from dht.identity import Identity, IdentityError, public_key_from_peer_id, verify

ROLES = ("server", "experts", "trainer", "relay", "coordinator")
PROOF_CONTEXT = b"swarmtrain credential request v1\n"
INVITE_CONTEXT = b"swarmtrain invite v1\n"
CLOCK_SKEW = datetime.timedelta(minutes=5)  # certificates start this long before issue: peers' clocks differ


class CredentialError(ValueError):
    """A certificate or request that does not make its holder an admitted peer of this run."""


class RevokedError(CredentialError):
    """A valid credential of a peer the run's coordinator revoked."""


def dns_name(public_bytes: bytes) -> str:
    """The TLS name of a peer, from its raw Ed25519 public key (DNS names are case-blind; peer ids are not)."""
    return f"p-{hashlib.sha256(public_bytes).hexdigest()[:32]}.swarmtrain"


def dns_name_of(peer_id: str) -> str:
    key = public_key_from_peer_id(peer_id)
    return dns_name(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def _uri(run: str, kind: str, value: str) -> str:
    return f"swarmtrain://{run}/{kind}/{value}"


def ownership_proof(identity: Identity, tls_public_key: ec.EllipticCurvePublicKey, nonce: bytes) -> bytes:
    """The peer's signature binding its TLS key to its identity, for one request (`nonce`)."""
    return identity.sign(PROOF_CONTEXT + _der(tls_public_key) + nonce)


def _der(key) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True)
class Credential:
    """What a valid certificate says about its holder."""

    run: str
    peer_id: str
    roles: tuple[str, ...]
    not_after: float  # unix time
    serial: int


class RunAuthority:
    """The coordinator's side: the run's CA certificate, and certificates for admitted peers."""

    def __init__(self, identity: Identity, run: str, lifetime: datetime.timedelta = datetime.timedelta(days=365)):
        self.identity, self.run = identity, run
        now = datetime.datetime.now(datetime.UTC)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"swarmtrain run {run}")])
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(identity.private_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + lifetime)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(identity.private_key.public_key()), critical=False)
            .sign(identity.private_key, None)
        )

    def pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        peer_id: str,
        tls_public_key: ec.EllipticCurvePublicKey,
        roles: tuple[str, ...],
        nonce: bytes,
        proof: bytes,
        ttl: float,
    ) -> x509.Certificate:
        """A certificate for `peer_id`'s TLS key; CredentialError if the proof or the roles are wrong.

        Admission (who may have which roles) is the caller's decision; this checks the request.
        """
        unknown = [r for r in roles if r not in ROLES]
        if not roles or unknown:
            raise CredentialError(f"roles must be some of {', '.join(ROLES)}, got {list(roles)}")
        if not isinstance(tls_public_key, ec.EllipticCurvePublicKey) or tls_public_key.curve.name != "secp256r1":
            raise CredentialError("the TLS key must be an ECDSA P-256 public key")
        if not verify(peer_id, PROOF_CONTEXT + _der(tls_public_key) + nonce, proof):
            raise CredentialError(f"the request is not signed by the key of peer {peer_id}")
        now = datetime.datetime.now(datetime.UTC)
        names = [x509.DNSName(dns_name_of(peer_id)), x509.UniformResourceIdentifier(_uri(self.run, "peer", peer_id))]
        names += [x509.UniformResourceIdentifier(_uri(self.run, "role", r)) for r in roles]
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer_id)]))
            .issuer_name(self.certificate.subject)
            .public_key(tls_public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + datetime.timedelta(seconds=ttl))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.identity.private_key.public_key()),
                critical=False,
            )
            .sign(self.identity.private_key, None)
        )


def invite_mac(secret: str, peer_id: str, tls_key_der: bytes, nonce: bytes) -> str:
    """Proof of knowing an invite code's secret, bound to one request, that does not reveal the secret."""
    message = INVITE_CONTEXT + peer_id.encode() + b"\n" + tls_key_der + nonce
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def tls_key_der(key) -> bytes:
    """The DER SubjectPublicKeyInfo of a (TLS) public key, as a credential request carries it."""
    return _der(key)


def read_credential(pem: bytes, coordinator: str, run: str, now: float | None = None) -> Credential:
    """What a peer's certificate (PEM or DER) says, after checking it: signed by `coordinator`'s key, this run, in date."""
    try:
        if pem.lstrip().startswith(b"-----"):
            cert = x509.load_pem_x509_certificate(pem)
        else:
            cert = x509.load_der_x509_certificate(pem)
    except ValueError as e:
        raise CredentialError(f"not a certificate: {e}") from None
    try:
        key = public_key_from_peer_id(coordinator)
    except IdentityError as e:
        raise CredentialError(str(e)) from None
    if not isinstance(key, Ed25519PublicKey):
        raise CredentialError("the coordinator's key is not Ed25519")
    try:
        key.verify(cert.signature, cert.tbs_certificate_bytes)
    except InvalidSignature:
        raise CredentialError("the certificate is not signed by this run's coordinator") from None
    when = (
        datetime.datetime.fromtimestamp(now, datetime.UTC) if now is not None else datetime.datetime.now(datetime.UTC)
    )
    if not cert.not_valid_before_utc <= when <= cert.not_valid_after_utc:
        raise CredentialError(
            f"the certificate is valid {cert.not_valid_before_utc} to {cert.not_valid_after_utc} only"
        )
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier
        )
    except x509.ExtensionNotFound:
        raise CredentialError("the certificate names no peer") from None
    prefix = f"swarmtrain://{run}/"
    peers = [u[len(prefix) + 5 :] for u in uris if u.startswith(prefix + "peer/")]
    roles = tuple(u[len(prefix) + 5 :] for u in uris if u.startswith(prefix + "role/"))
    if len(peers) != 1:
        raise CredentialError(f"the certificate is not for one peer of run {run!r}")
    return Credential(run, peers[0], roles, cert.not_valid_after_utc.timestamp(), cert.serial_number)

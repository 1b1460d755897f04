"""Mutual TLS for benchmark processes that serve our gRPC services without a coordinator: a run authority whose
key the parent writes once (`make_authority`), and for each process a certificate it issues itself for its own
peer id (`BenchCredential`, what peer.net.client needs of a peer.net.security.Security, plus server credentials).
The CA certificate is the parent's, read from the same directory, so every process trusts the same root."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from dht.credential import RunAuthority, dns_name_of, ownership_proof
from dht.identity import Identity

RUN = "bench"


def make_authority(directory: Path) -> None:
    """The run's authority for a benchmark: its key (authority.pem) and CA certificate (ca.pem) in `directory`."""
    identity = Identity.generate()
    identity.save(directory / "authority.pem")
    (directory / "ca.pem").write_bytes(RunAuthority(identity, RUN).pem())


class BenchCredential:
    """A certificate for `identity`'s peer id with `roles`, issued by the authority in `directory`."""

    def __init__(self, directory: Path, identity: Identity, roles: tuple[str, ...] = ("server",)):
        authority = RunAuthority(Identity.load(directory / "authority.pem"), RUN)
        key, nonce = ec.generate_private_key(ec.SECP256R1()), os.urandom(16)
        proof = ownership_proof(identity, key.public_key(), nonce)
        cert = authority.issue(identity.peer_id, key.public_key(), roles, nonce, proof, 3600)
        self.key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        self.cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        self.ca_pem = (directory / "ca.pem").read_bytes()
        self.generation = 1

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca_pem, self.key_pem, self.cert_pem)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem, require_client_auth=True
        )

    def target_name(self, peer_id: str) -> str:
        return dns_name_of(peer_id)

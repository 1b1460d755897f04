"""Credentials (issue 8, in progress): the coordinator's certificates for admitted peers, and TLS with them."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dht.credential import CredentialError, RunAuthority, dns_name_of, ownership_proof, read_credential
from dht.identity import Identity


def issue(ca: RunAuthority, peer: Identity, roles=("server",), ttl=3600.0):
    key = ec.generate_private_key(ec.SECP256R1())
    nonce = os.urandom(16)
    cert = ca.issue(peer.peer_id, key.public_key(), roles, nonce, ownership_proof(peer, key.public_key(), nonce), ttl)
    return key, cert


def pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def test_a_certificate_names_its_peer_roles_and_run_and_nothing_else_passes():
    coordinator, peer, other = Identity.generate(), Identity.generate(), Identity.generate()
    ca = RunAuthority(coordinator, "run-a")
    _, cert = issue(ca, peer, ("server", "trainer"), ttl=60)
    cred = read_credential(pem(cert), coordinator.peer_id, "run-a")
    assert (cred.peer_id, cred.roles, cred.run) == (peer.peer_id, ("server", "trainer"), "run-a")
    assert time.time() < cred.not_after <= time.time() + 61
    with pytest.raises(CredentialError, match="not signed by this run's coordinator"):
        read_credential(pem(cert), other.peer_id, "run-a")
    with pytest.raises(CredentialError, match="not for one peer of run 'run-b'"):
        read_credential(pem(cert), coordinator.peer_id, "run-b")
    with pytest.raises(CredentialError, match="valid"):
        read_credential(pem(cert), coordinator.peer_id, "run-a", now=time.time() + 120)
    # a request must be signed by the peer's own identity key, for this TLS key and nonce
    key = ec.generate_private_key(ec.SECP256R1())
    with pytest.raises(CredentialError, match="not signed by the key of peer"):
        ca.issue(peer.peer_id, key.public_key(), ("server",), b"n", ownership_proof(other, key.public_key(), b"n"), 60)
    with pytest.raises(CredentialError, match="not signed by the key of peer"):
        ca.issue(peer.peer_id, key.public_key(), ("server",), b"m", ownership_proof(peer, key.public_key(), b"n"), 60)
    with pytest.raises(CredentialError, match="roles must be some of"):
        ca.issue(peer.peer_id, key.public_key(), ("root",), b"n", ownership_proof(peer, key.public_key(), b"n"), 60)


def test_mutual_tls_with_run_certificates_pins_the_server_peer():
    """gRPC TLS with the coordinator as CA: the server sees who calls; the caller reaches only the named peer."""
    coordinator, server_peer, client_peer, stranger = (Identity.generate() for _ in range(4))
    ca = RunAuthority(coordinator, "run-a")
    server_key, server_cert = issue(ca, server_peer, ("server",))
    client_key, client_cert = issue(ca, client_peer, ("trainer",))
    seen = []

    class Peek(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            handler = await continuation(details)

            async def call(request, context, inner=handler.unary_unary):
                uri = context.auth_context().get("x509_pem_cert", [b""])[0]
                seen.append(read_credential(uri, coordinator.peer_id, "run-a"))
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(call, handler.request_deserializer, handler.response_serializer)

    def key_pem(key):
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    async def main():
        server = grpc.aio.server(interceptors=[Peek()])
        health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
        creds = grpc.ssl_server_credentials([(key_pem(server_key), pem(server_cert))], ca.pem(), True)
        port = server.add_secure_port("127.0.0.1:0", creds)
        await server.start()
        results = []
        try:
            for expected in (server_peer, stranger):
                channel = grpc.aio.secure_channel(
                    f"127.0.0.1:{port}",
                    grpc.ssl_channel_credentials(ca.pem(), key_pem(client_key), pem(client_cert)),
                    options=[("grpc.ssl_target_name_override", dns_name_of(expected.peer_id))],
                )
                try:
                    await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    results.append("ok")
                except grpc.aio.AioRpcError as e:
                    results.append(e.code())
                finally:
                    await channel.close()
        finally:
            await server.stop(None)
        return results

    assert asyncio.run(main()) == ["ok", grpc.StatusCode.UNAVAILABLE]  # the stranger's name: no handshake
    assert [(c.peer_id, c.roles) for c in seen] == [(client_peer.peer_id, ("trainer",))]


def test_a_record_counts_only_from_a_role_that_may_publish_it():
    """Item 5 of issue 24: a trainer's credential does not make its ServerRecord (or relay record) count, nor a
    server's its TrainerRecord or spot-check report; stage records need `server`, expert records `experts`."""
    from dht.gate import Gate
    from dht.records import RelayRecord, ServerRecord, SpotCheckReport, TrainerRecord

    coordinator = Identity.generate()
    ca = RunAuthority(coordinator, "run-a")
    gate = Gate("run-a", coordinator.peer_id)
    certs = {}
    for role in ("server", "experts", "trainer", "relay"):
        peer = Identity.generate()
        certs[role] = (peer.peer_id, pem(issue(ca, peer, (role,))[1]))
    stage, expert = (
        ServerRecord(stage=0, endpoint="h:1", throughput=1),
        ServerRecord(stage=0, expert="0.1", endpoint="h:1", throughput=1),
    )
    records = {
        "stage": stage,
        "expert": expert,
        "trainer": TrainerRecord(),
        "relay": RelayRecord(endpoint="h:2"),
        "report": SpotCheckReport(),
    }
    allowed = {
        "stage": {"server"},
        "expert": {"experts"},
        "trainer": {"trainer"},
        "relay": {"relay", "server", "experts"},
        "report": {"trainer"},
    }
    for name, record in records.items():
        for role, (peer_id, cert) in certs.items():
            assert gate.may_write(peer_id, cert, record.writers()) == (role in allowed[name]), (name, role)
        assert gate.may_write(coordinator.peer_id, None, record.writers())  # the run's authority writes any


def test_the_revocation_list_outlives_every_credential_it_revokes():
    """A revoked peer's last credential stays valid up to admission.credential_ttl; the list once lived
    security.revocations_ttl (120 s) only, so a peer that started while the coordinator had been away longer read no
    list while that credential was still good. It now lives a credential's lifetime at least, and is stored again,
    unchanged, as often as before (a third of revocations_ttl, or of 4 refreshes)."""
    from peer.config import PeerConfig, RunSpec
    from peer.net.security import revocation_periods

    spec, cfg = RunSpec(), PeerConfig()
    assert revocation_periods(spec, cfg) == (spec.admission.credential_ttl, cfg.security.revocations_ttl / 3)
    spec.admission.refresh, spec.admission.credential_ttl = 60.0, 100.0
    assert revocation_periods(spec, cfg) == (240.0, 80.0)  # 4 refreshes, past the credential's life

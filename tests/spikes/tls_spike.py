"""Spike for issue 8 (not a test): which certificates gRPC Python's TLS accepts for mutual TLS.

    python tests/spikes/tls_spike.py ed|ec|mixed EXPECTED_SERVER_NAME

- `ed`: Ed25519 CA and Ed25519 leaves: refused (BoringSSL: NO_COMMON_SIGNATURE_ALGORITHMS).
- `ec`: ECDSA P-256 everywhere: works.
- `mixed`: an Ed25519 CA (the coordinator's identity key) signing ECDSA P-256 leaves: works.
With `mixed`, a server interceptor sees the client's certificate (peer_uri, peer_dns, x509_pem_cert
in auth_context), and a client whose target name override differs from the server's DNS SAN is
refused in the handshake. Findings in docs/security.md.
"""

from __future__ import annotations

import asyncio
import datetime
import sys

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc


def pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def certificate(subject_key, issuer_key, name: str, issuer: str, ca: bool, algorithm):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(subject_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        names = [x509.DNSName(f"p-{name}.swarmtrain"), x509.UniformResourceIdentifier(f"swarmtrain:peer/{name}")]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, algorithm)


def keys(kind: str):
    if kind == "ec":
        return ec.generate_private_key(ec.SECP256R1()), [ec.generate_private_key(ec.SECP256R1()) for _ in range(2)]
    leaf = (
        (lambda: ed25519.Ed25519PrivateKey.generate())
        if kind == "ed"
        else (lambda: ec.generate_private_key(ec.SECP256R1()))
    )
    return ed25519.Ed25519PrivateKey.generate(), [leaf(), leaf()]


seen: list[dict] = []


class Peek(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        inner = handler.unary_unary

        async def wrapped(request, context):
            seen.append(dict(context.auth_context()))
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(wrapped, handler.request_deserializer, handler.response_serializer)


async def main(kind: str, expected: str) -> None:
    ca_key, (server_key, client_key) = keys(kind)
    algorithm = None if isinstance(ca_key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    ca = certificate(ca_key, ca_key, "run-ca", "run-ca", True, algorithm)
    server_cert = certificate(server_key, ca_key, "server", "run-ca", False, algorithm)
    client_cert = certificate(client_key, ca_key, "client", "run-ca", False, algorithm)
    server = grpc.aio.server(interceptors=[Peek()])
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    credentials = grpc.ssl_server_credentials(
        [(pem_key(server_key), pem(server_cert))], root_certificates=pem(ca), require_client_auth=True
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    channel = grpc.aio.secure_channel(
        f"127.0.0.1:{port}",
        grpc.ssl_channel_credentials(pem(ca), pem_key(client_key), pem(client_cert)),
        options=[("grpc.ssl_target_name_override", expected)],
    )
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        print(kind, "accepted; the server saw", {k: seen[0][k] for k in ("peer_uri", "peer_dns")})
    except grpc.aio.AioRpcError as e:
        print(kind, "refused:", e.code().name)
    finally:
        await channel.close()
        await server.stop(None)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "p-server.swarmtrain"))

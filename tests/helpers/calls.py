"""The test process as a peer of a swarm it started: admitted gRPC channels and clients to its servers,
their Info, and the checks of a stage's books (every sample counted once)."""

from __future__ import annotations

import os
import time
import tomllib
from pathlib import Path

from helpers.swarm import _SERVERS


class TestCredential:
    """A credential for the test process itself, signed with the run's coordinator key (the test owns
    the run): what peer.net.client needs of a peer.net.security.Security."""

    def __init__(self, workdir: Path, roles: tuple[str, ...] = ("trainer", "server")):
        import grpc
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        from dht.credential import RunAuthority, ownership_proof
        from dht.identity import Identity

        spec = tomllib.loads((workdir / "run.toml").read_text())
        authority = RunAuthority(Identity.load(workdir / "coordinator.pem"), spec.get("name", "swarmtrain"))
        self.identity, key = Identity.generate(), ec.generate_private_key(ec.SECP256R1())
        nonce = os.urandom(16)
        proof = ownership_proof(self.identity, key.public_key(), nonce)
        cert = authority.issue(self.identity.peer_id, key.public_key(), roles, nonce, proof, 3600)
        self.certificate = cert.public_bytes(serialization.Encoding.DER)  # what its signed records carry
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        self.generation = 1
        self.credentials = grpc.ssl_channel_credentials(
            authority.pem(), key_pem, cert.public_bytes(serialization.Encoding.PEM)
        )

    def channel_credentials(self):
        return self.credentials

    def target_name(self, peer_id: str) -> str:
        from dht.credential import dns_name_of

        return dns_name_of(peer_id)


def peer_at(endpoint: str) -> str:
    """The peer id of the server the swarm fixture started at `endpoint`."""
    from dht.identity import Identity

    return Identity.load(_SERVERS[endpoint][1]).peer_id


def test_credential(endpoint: str) -> TestCredential | None:
    """A credential good for the run `endpoint` belongs to (None when that run has admission off)."""
    workdir = _SERVERS[endpoint][0]
    spec = tomllib.loads((workdir / "run.toml").read_text())
    if spec.get("admission", {}).get("mode", "invite") == "off":
        return None
    return TestCredential(workdir)


def channel(endpoint: str, credential: TestCredential | None = None):
    """A gRPC channel of this test process to `endpoint` (a server started by the swarm fixture), admitted with
    `credential` or a new one."""
    import grpc

    credential = credential or test_credential(endpoint)
    if credential is None:
        return grpc.insecure_channel(endpoint)
    options = [("grpc.ssl_target_name_override", credential.target_name(peer_at(endpoint)))]
    return grpc.secure_channel(endpoint, credential.channel_credentials(), options=options)


def client(endpoint: str, *args, **kwargs):
    """A peer.net.client.StageClient of this test process, admitted to the run `endpoint` belongs to; a call that
    names no peer pins the one the swarm fixture started at its endpoint."""
    from peer.net.client import StageClient

    class FixtureClient(StageClient):
        def _channel(self, endpoint: str, peer: str | None = None):
            return super()._channel(endpoint, peer or (peer_at(endpoint) if self.security is not None else None))

    return FixtureClient(*args, security=test_credential(endpoint), **kwargs)


def settled_infos(endpoints: list[str], timeout: float = 30.0) -> list:
    """Info of each live replica of a stage, once they all sit at the same step with nothing in flight."""
    deadline = time.monotonic() + timeout
    while True:
        infos = [info(e) for e in endpoints]
        agree = len({i.epoch for i in infos}) == 1 and len({i.samples_stepped for i in infos}) == 1
        if agree and not any(i.samples_averaging for i in infos):
            return infos
        if time.monotonic() > deadline:
            raise AssertionError(f"replicas never agreed: {[(i.epoch, i.samples_stepped) for i in infos]}")
        time.sleep(0.25)


def books_balance(swarm, samples: int, stages: int = 2, timeout: float = 90) -> str:
    """`peer status` until the coordinator's books balance for every stage at `samples` completed; its output."""
    deadline, attempt = time.monotonic() + timeout, 0
    while True:
        attempt += 1
        status = swarm.start(f"status{attempt}", ["status", swarm.maddr])
        assert status.wait(60) == 0, status.output()[-3000:]
        out = status.output()
        if "they balance" in out and out.count(f": balanced ({samples} completed;") == stages:
            return out
        assert time.monotonic() < deadline, out[-3000:]
        time.sleep(1.0)


def check_books(infos: list, samples: int, stage: int) -> None:
    stepped = infos[0].samples_stepped
    pending = sum(i.samples_accumulated + i.samples_averaging for i in infos)
    assert stepped + pending == samples, f"stage {stage}: {stepped} stepped + {pending} pending != {samples} completed"


def info(endpoint: str, timeout: float = 10.0):
    """The Info of a stage server, over a short-lived gRPC channel."""
    from protocols import stage_pb2, stage_pb2_grpc

    with channel(endpoint) as ch:
        return stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=timeout)


test_credential.__test__ = False  # a helper, not a test
TestCredential.__test__ = False

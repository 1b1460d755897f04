"""Throwaway keys that flood the coordinator with credential requests (tests/test_attacks.py runs it).

`flood.py MADDR COUNT SECONDS`: COUNT fresh identities each store a valid credential request (a trainer's,
with its proof of key) under the run's admission key, to live SECONDS: what anyone can do in open mode at
no cost. It prints `FLOOD stored N` once they are in.

`flood.py MADDR COUNT SECONDS --malformed INVITE_ID`: the requests are signed and well-formed records, but each is
malformed for the coordinator in one of the ways that once ended its whole pass (so that no peer was admitted or
renewed again while they lived): a TLS key of a curve nobody supports, an invite MAC that is not ASCII (for a
real invite id), a TLS key that is not DER.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

import msgpack
from cryptography.hazmat.primitives.asymmetric import ec
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from dht import envelope, keys
from dht.address import coordinator_peer_id
from dht.credential import ownership_proof, tls_key_der
from dht.identity import Identity
from dht.node import SwarmDHT
from dht.records import CredentialRequest
from peer.swarm.discovery import fetch_spec


def request_of(throwaway: Identity) -> CredentialRequest:
    tls, nonce = ec.generate_private_key(ec.SECP256R1()), os.urandom(16)
    return CredentialRequest(
        tls_key=tls_key_der(tls.public_key()).hex(),
        roles=["trainer"],
        nonce=nonce.hex(),
        proof=ownership_proof(throwaway, tls.public_key(), nonce).hex(),
    )


P256 = bytes.fromhex("06082A8648CE3D030107")  # the curve's OID in a P-256 key's DER


def malformed(throwaway: Identity, i: int, invite: str) -> CredentialRequest:
    request = request_of(throwaway)
    if i % 3 == 0:  # a curve of an OID no library has (cryptography raises UnsupportedAlgorithm, not ValueError)
        request.tls_key = bytes.fromhex(request.tls_key).replace(P256, bytes.fromhex("06082A8648CE3D030109")).hex()
    elif i % 3 == 1:  # compare_digest refuses str that is not ASCII (TypeError)
        request.invite, request.invite_mac = invite, "\u00e9" * 64
    else:
        request.tls_key = "00ff"
    return request


def main(maddr: str, count: int, seconds: float, invite: str = "") -> None:
    mp.set_start_method("fork", force=True)
    dht = SwarmDHT(Identity.generate(), [maddr], ["/ip4/127.0.0.1/tcp/0"], [], 20.0, 5.0)
    try:
        spec = fetch_spec(dht, coordinator_peer_id(maddr), timeout=20.0)
        key = keys.credential_requests_key(spec.name)
        key_id = DHTID.generate(source=key).to_bytes()

        def store(throwaway: Identity, payload: bytes, expiration: float):
            subkey = keys.signed_subkey(throwaway.peer_id)
            sealed = envelope.seal(
                throwaway, key_id, msgpack.packb(subkey, use_bin_type=True), expiration, payload, None
            )
            return dht.dht.store(key, sealed, expiration, subkey=subkey, return_future=True)

        futures = []
        for i in range(count):
            throwaway = Identity.generate()
            payload = (malformed(throwaway, i, invite) if invite else request_of(throwaway)).model_dump_json().encode()
            expiration = get_dht_time() + seconds
            futures.append((throwaway, payload, expiration, store(throwaway, payload, expiration)))
        stored = 0
        for throwaway, payload, expiration, future in futures:
            done = bool(future.result(timeout=60))
            for again in range(1, 5 if invite else 1):  # a busy node did not answer in time: stored again, with a
                if done:  # later expiration (a node keeps the newest of a subkey: the same one would be refused)
                    break
                done = bool(store(throwaway, payload, expiration + again).result(timeout=60))
            stored += done
        print(f"FLOOD stored {stored}", flush=True)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[5] if sys.argv[4:5] == ["--malformed"] else "")

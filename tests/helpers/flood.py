"""Throwaway keys that flood the coordinator with credential requests (tests/test_attacks.py runs it).

`flood.py MADDR COUNT SECONDS`: COUNT fresh identities each store a valid credential request (a trainer's,
with its proof of key) under the run's admission key, to live SECONDS: what anyone can do in open mode at
no cost. It prints `FLOOD stored N` once they are in.
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


def main(maddr: str, count: int, seconds: float) -> None:
    mp.set_start_method("fork", force=True)
    dht = SwarmDHT(Identity.generate(), [maddr], ["/ip4/127.0.0.1/tcp/0"], [], 20.0, 5.0)
    try:
        spec = fetch_spec(dht, coordinator_peer_id(maddr), timeout=20.0)
        key = keys.credential_requests_key(spec.name)
        key_id = DHTID.generate(source=key).to_bytes()
        futures = []
        for _ in range(count):
            throwaway = Identity.generate()
            subkey, expiration = keys.signed_subkey(throwaway.peer_id), get_dht_time() + seconds
            payload = request_of(throwaway).model_dump_json().encode()
            sealed = envelope.seal(
                throwaway, key_id, msgpack.packb(subkey, use_bin_type=True), expiration, payload, None
            )
            futures.append(dht.dht.store(key, sealed, expiration, subkey=subkey, return_future=True))
        stored = sum(bool(f.result(timeout=60)) for f in futures)
        print(f"FLOOD stored {stored}", flush=True)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))

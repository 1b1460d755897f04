"""An admitted peer that announces another server's endpoint as its own (tests/test_attacks.py runs it).

`impostor.py MADDR IDENTITY STAGE ENDPOINT SECONDS ROLE [STATE EPOCH [STEP]]`: it is admitted with ROLE (`server`: it
may announce servers; `trainer`: it may not, and its record must count nowhere). With STATE (`trained`, `archive`)
and EPOCH, its record is one only the coordinator may write: that the stage was trained to EPOCH, or that a
checkpoint of it at EPOCH is served at ENDPOINT, and that the coordinator takes the handover of its last server.
EPOCH -1: the stage's own step, as above. STEP: the training step its record claims beside its epoch (in gradient
mode the two are one: a record of a normal epoch and a step of 10^9 said the run had ended).

It keeps storing a `ServerRecord` of its own for STAGE that names ENDPOINT (an honest server's), serving,
at the stage's step and with a throughput far above anyone's, so trainers pick it first. A caller that
pinned the TLS name by endpoint would then expect this peer at the honest server's address: every call
there would fail the handshake, and the honest server would be blamed. It prints `IMPOSTOR up PEER_ID`.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

from dht import keys
from dht.identity import Identity
from dht.records import ServerRecord
from peer.cli.join import connect
from peer.config import PeerConfig


def main(
    maddr: str,
    identity_path: str,
    stage: int,
    endpoint: str,
    seconds: float,
    role: str,
    state: str,
    epoch: int,
    claimed_step: int,
) -> None:
    mp.set_start_method("fork", force=True)
    cfg = PeerConfig()
    cfg.network.host, cfg.network.dht_host_maddrs = "127.0.0.1", ["/ip4/127.0.0.1/tcp/0"]
    identity = Identity.load_or_create(identity_path)
    dht, spec = connect(maddr, cfg, identity, role)
    key = keys.servers_key(spec.name, stage)
    print(f"IMPOSTOR up {identity.peer_id}", flush=True)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            honest = [r for pid, r in dht.get(key, ServerRecord).items() if pid != identity.peer_id]
            step = epoch if epoch >= 0 else max((r.epoch for r in honest), default=0)
            now = time.time()
            fake = ServerRecord(
                stage=stage,
                endpoint=endpoint,
                throughput=1e6,
                epoch=step,
                step=claimed_step if claimed_step >= 0 else step,
                state=state,
                takes_handover=state in ("trained", "archive"),
                updated=now,
                started=now,
            )
            dht.store(key, fake, ttl=10.0)
            time.sleep(0.5)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    maddr, identity_path, stage, endpoint, seconds, role = sys.argv[1:7]
    state, epoch = (sys.argv[7], int(sys.argv[8])) if len(sys.argv) > 8 else ("serving", -1)
    claimed_step = int(sys.argv[9]) if len(sys.argv) > 9 else -1
    main(maddr, identity_path, int(stage), endpoint, float(seconds), role, state, epoch, claimed_step)

"""A key admitted as a trainer that has trained nothing and reports an honest server anyway
(tests/test_attacks.py runs it): `reporter.py MADDR IDENTITY PEER SECONDS [SAMPLES]`. With SAMPLES, it also
announces itself as a trainer that has completed that many samples (its own word). It prints `REPORTER up`."""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

from dht import keys
from dht.identity import Identity
from dht.records import SpotCheckReport, TrainerRecord
from peer.cli.join import connect
from peer.config import PeerConfig


def main(maddr: str, identity_path: str, accused: str, seconds: float, samples: int = 0) -> None:
    mp.set_start_method("fork", force=True)
    cfg = PeerConfig()
    cfg.network.host, cfg.network.dht_host_maddrs = "127.0.0.1", ["/ip4/127.0.0.1/tcp/0"]
    dht, spec = connect(maddr, cfg, Identity.load_or_create(identity_path), "trainer")
    print("REPORTER up", flush=True)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            report = SpotCheckReport(wrong={accused: 5}, caught={accused: time.time()}, updated=time.time())
            dht.store(keys.reports_key(spec.name), report, ttl=30.0)
            if samples:
                claim = TrainerRecord(
                    samples=samples, micro_batches=samples // 4, started=time.time(), updated=time.time()
                )
                dht.store(keys.trainers_key(spec.name), claim, ttl=30.0)
            time.sleep(1.0)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 0)

"""The control plane at rest: a server that serves nobody reads its replicas' records seldom, and at its fast
period again as soon as it is used (peer.server.replica: `_next_read_period`, `stir`). Real processes; the
DHT operations each peer made come from its own metrics endpoint (`swarm_dht_{stores,gets}_total`)."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

SPEC = {
    "name": "quiet",
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "max_seq_len": 16},
    "stages": {"num_stages": 1},
    "training": {"micro_batch_size": 4, "seq_len": 16, "target_batch_size": 8, "total_steps": 1000},
    "admission": {"refresh": 120.0},  # the revocation list read seldom: what the test counts is the replicas' reads
}
QUIET = ["--set", "server.balance_period=120"]  # and the balance checks' reads as seldom


def dht_operations(peer) -> tuple[float, float]:
    """(stores, reads) the peer made so far, from its metrics."""
    address = peer.wait_for(r"Prometheus metrics at (http://\S+/metrics)", 60).group(1)
    text = urllib.request.urlopen(address, timeout=10).read().decode()
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return values["swarm_dht_stores_total"], values["swarm_dht_gets_total"]


def window(peer, stores: int, timeout: float) -> tuple[float, float, float]:
    """(stores, reads, seconds) over the time the peer takes to make `stores` more stores."""
    first, started = dht_operations(peer), time.monotonic()
    while (now := dht_operations(peer))[0] - first[0] < stores:
        assert time.monotonic() - started < timeout, f"{peer.name} made {now[0] - first[0]:.0f} stores"
        time.sleep(0.5)
    return now[0] - first[0], now[1] - first[1], time.monotonic() - started


def test_a_resting_server_reads_seldom_and_a_used_one_at_its_fast_period_again(swarm):
    swarm.coordinator(SPEC)
    servers = [swarm.server(f"s{i}", 0, QUIET) for i in range(2)]
    for server in servers:
        swarm.endpoint(server)
    # at rest: the read period has doubled up to network.rest_read_period (8 s) while the record is refreshed
    # every announce period (2 s); awake, a replica reads every progress period (0.5 s), four times as often
    window(servers[0], 2, 60)  # past the first reads, whose period is still growing
    stores, reads, seconds = window(servers[0], 8, 60)
    assert reads <= stores / 2, f"at rest: {reads:.0f} reads and {stores:.0f} stores in {seconds:.1f} s"
    trainer = swarm.trainer("t", ["--seed", "1", "--max-inflight", "1"])
    deadline = time.monotonic() + 120
    while not any(e["type"] == "micro_batch" for e in swarm.log("t")):
        assert time.monotonic() < deadline and trainer.proc.poll() is None, trainer.output()[-3000:]
        time.sleep(0.5)
    stores, reads, seconds = window(servers[0], 4, 60)
    assert reads / seconds >= 1.0, f"in use: {reads:.0f} reads and {stores:.0f} stores in {seconds:.1f} s"

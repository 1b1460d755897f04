"""The control plane at rest: a server that serves nobody reads its replicas' records seldom, and at its fast
period again as soon as it is used (peer.server.replica: `_next_read_period`, `stir`). Real processes; the
DHT operations each peer made come from its own metrics endpoint (`swarm_dht_{stores,gets}_total`)."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import pytest
import torch
from helpers.calls import client
from prometheus_client.parser import text_string_to_metric_families

from protocols import codec, stage_pb2

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


def forward(endpoint: str) -> None:
    """One inference forward of this test process to the server at `endpoint`: a request, so activity."""
    header, payload = codec.encode_payload(torch.zeros(1, 16, dtype=torch.long))
    request = stage_pb2.ForwardRequest(run_id=SPEC["name"], stage=0, uid="probe", inputs=header)

    async def call():
        stage_client = client(endpoint, 1 << 20, 1 << 24)
        try:
            await stage_client.forward(endpoint, request, {"inputs": payload}, timeout=30)
        finally:
            await stage_client.close()

    asyncio.run(call())


def test_a_resting_server_reads_seldom_and_a_used_one_at_its_fast_period_again(swarm):
    swarm.coordinator(SPEC)
    servers = [swarm.server(f"s{i}", 0, QUIET) for i in range(2)]
    endpoints = [swarm.endpoint(server) for server in servers]
    # at rest: the read period has doubled up to network.rest_read_period (8 s) while the record is refreshed
    # every announce period (2 s); awake, a replica reads every progress period (0.5 s), four times as often
    window(servers[0], 8, 60)  # past the first reads, whose period is still growing
    stores, reads, seconds = window(servers[0], 8, 60)
    assert reads <= stores / 2, f"at rest: {reads:.0f} reads and {stores:.0f} stores in {seconds:.1f} s"
    # one request wakes it: it reads at once, not at the end of the 8 s it was resting
    before, asked = dht_operations(servers[0])[1], time.monotonic()
    try:
        forward(endpoints[0])
    except grpc.aio.AioRpcError as e:  # the answer does not matter here, only that a request came
        assert e.code() != grpc.StatusCode.UNAVAILABLE, e
    while dht_operations(servers[0])[1] <= before:
        assert time.monotonic() - asked < 4.0, "a request did not wake the resting server's reads"
        time.sleep(0.1)
    # in use (a trainer): it reads at its fast period, far more often than at rest
    trainer = swarm.trainer("t", ["--seed", "1", "--max-inflight", "1"])
    deadline = time.monotonic() + 120
    while not any(e["type"] == "micro_batch" for e in swarm.log("t")):
        assert time.monotonic() < deadline and trainer.proc.poll() is None, trainer.output()[-3000:]
        time.sleep(0.5)
    first, started = dht_operations(servers[0]), time.monotonic()
    while time.monotonic() - started < 8.0:  # a fixed window, measured: the rate is what is compared
        time.sleep(0.5)
    busy_reads = dht_operations(servers[0])[1] - first[1]
    assert busy_reads >= 3 * max(reads, 1.0) * 8.0 / seconds, f"in use: {busy_reads:.0f} reads in 8 s"

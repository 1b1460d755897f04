"""The control plane at rest: a server that serves nobody reads its replicas' records and refreshes its own
seldom, and at its fast periods again as soon as it is used (peer.server.replica: `_next_read_period`, `stir`;
peer.net.cadence); in use, replicas push their progress to each other (peer.server.replica_push). Real processes; the
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
    "admission": {
        "mode": "open",
        "refresh": 120.0,
    },  # the revocation list read seldom: what the test counts is the replicas' reads
}
QUIET = ["--set", "server.balance_period=120"]  # and the balance checks' reads as seldom


def metric_values(peer) -> dict[str, float]:
    """The peer's metrics now (unlabelled samples by name)."""
    address = peer.wait_for(r"Prometheus metrics at (http://\S+/metrics)", 60).group(1)
    text = urllib.request.urlopen(address, timeout=10).read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def dht_operations(peer) -> tuple[float, float]:
    """(stores, reads) the peer made so far, from its metrics."""
    values = metric_values(peer)
    return values["swarm_dht_stores_total"], values["swarm_dht_gets_total"]


def settled(peer, span: float, timeout: float) -> tuple[float, float]:
    """(stores, reads) of the first window of `span` s in which the peer made at most one store and one read
    (its periods have grown to the rest ones); fails after `timeout` s."""
    started = time.monotonic()
    while True:
        first, opened = dht_operations(peer), time.monotonic()
        while time.monotonic() - opened < span:  # a fixed window, measured: the rate is what is compared
            time.sleep(0.5)
        now = dht_operations(peer)
        stores, reads = now[0] - first[0], now[1] - first[1]
        if stores <= 1 and reads <= 1:
            return stores, reads
        assert time.monotonic() - started < timeout, f"{peer.name}: {stores:.0f} stores, {reads:.0f} reads in {span} s"


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


def test_a_resting_server_reads_and_announces_seldom_and_a_used_one_at_its_fast_periods_again(swarm):
    swarm.coordinator(SPEC)
    servers = [swarm.server(f"s{i}", 0, QUIET) for i in range(2)]
    endpoints = [swarm.endpoint(server) for server in servers]
    # at rest the read period doubles up to network.rest_read_period (32 s) and the record's refresh period up
    # to network.rest_announce_period (32 s): a window of 16 s holds at most one of each (it held 8 stores and 32
    # reads awake, at the announce and progress periods)
    settled(servers[0], 16.0, 120)
    # one request wakes it: it reads at once, not at the end of the 32 s it was resting, and refreshes its
    # record at the announce period again (2 s)
    before, asked = dht_operations(servers[0]), time.monotonic()
    try:
        forward(endpoints[0])
    except grpc.aio.AioRpcError as e:  # the answer does not matter here, only that a request came
        assert e.code() != grpc.StatusCode.UNAVAILABLE, e
    while dht_operations(servers[0])[1] <= before[1]:
        assert time.monotonic() - asked < 4.0, "a request did not wake the resting server's reads"
        time.sleep(0.1)
    while dht_operations(servers[0])[0] <= before[0]:
        assert time.monotonic() - asked < 6.0, "a request did not bring the resting server's refreshes back"
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
    busy = [b - a for a, b in zip(first, dht_operations(servers[0]), strict=True)]
    # in use the replicas push their progress to each other (peer.server.replica_push) and read the DHT's records
    # once an announce period (2 s), and refresh their own as often and at each step: 4 or more of each in 8 s,
    # less a half for a busy machine; many times the one of each that a resting window of 16 s held, and at most
    # half the 16 reads the progress period (0.5 s) made before the pushes
    assert busy[1] >= 2 and busy[0] >= 2, f"in use: {busy[0]:.0f} stores and {busy[1]:.0f} reads in 8 s"
    assert busy[1] <= 8, f"in use: {busy[1]:.0f} reads in 8 s: the replicas read the DHT as if nothing were pushed"
    for server in servers:  # both sides pushed and took the other's records, and they stepped together
        values = metric_values(server)
        assert values["swarm_progress_pushes_total"] > 0 and values["swarm_progress_pushes_taken_total"] > 0, values


def test_a_record_refreshes_seldom_at_rest_and_never_claims_to_live_longer_than_a_resting_one():
    """peer.net.cadence on its own: the period doubles while nothing changes, its lifetime keeps the margin over
    the period it waits, a change shortens the period but not what the DHT holds, and a reader bounds what a
    record states (a hostile one cannot stay 'alive' longer than an honest resting one)."""
    from peer.config import NetworkConfig
    from peer.net.cadence import Cadence, lifetime, longest_ttl

    net = NetworkConfig()
    cadence, now, periods = Cadence(net), 1000.0, []
    for _ in range(6):
        ttl = cadence.ttl(changed=False, now=now)
        assert ttl - cadence.next_period(False) >= net.record_ttl - net.announce_period  # the margin is kept
        cadence.stored(ttl, changed=False, now=now)
        periods.append(cadence.period)
        now += cadence.period
    assert periods == [4.0, 8.0, 16.0, 32.0, 32.0, 32.0]
    held = now - 32.0 + longest_ttl(net)  # the last refresh's end
    ttl = cadence.ttl(changed=True, now=now)
    assert now + ttl >= held, "a short lifetime after a long one would be refused by hivemind"
    cadence.stored(ttl, changed=True, now=now)
    assert cadence.period == net.announce_period
    assert lifetime(0.0, net) == net.record_ttl  # an older peer states none
    assert lifetime(1e9, net) == longest_ttl(net) == 40.0

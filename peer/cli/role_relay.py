"""`peer join --role relay`: only carry the calls of peers that cannot be dialled (peer.net.relay)."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dht.identity import Identity
from peer.cli.join import connect, follow_admission, until_signalled
from peer.config import PeerConfig
from peer.net.metrics import open_metrics, serve_metrics
from peer.net.relay import RelayService, add_relay
from peer.net.serving import announce_host, grpc_server, listen


def run_relay(maddr: str, cfg: PeerConfig, identity: Identity, coordinator: str | None = None) -> None:
    """A peer that only relays: carries the calls of peers that cannot be dialled (peer.net.relay)."""
    dht, spec = connect(maddr, cfg, identity, "relay", coordinator)
    try:
        net = cfg.network
        relay = RelayService(cfg, spec.name, announce_host(net.host, net.announce_host), dht.security, "relay")
        metrics = open_metrics(cfg, "relay", relay.levels, dht)
        done, tasks = asyncio.Event(), []

        async def start():
            follow_admission(dht, done.set)
            serve_metrics(metrics, cfg)
            server = grpc_server(cfg, dht.security)
            add_relay(server, relay)
            checker = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(checker, server)
            port = listen(server, f"{net.host}:{net.port}", dht.security)
            await server.start()
            await checker.set("", health_pb2.HealthCheckResponse.SERVING)
            relay.endpoint = f"{relay.announce_host}:{port}"
            tasks.extend([server, asyncio.create_task(relay.announce(dht))])
            print(f"Relaying for peers that cannot be dialled, at {relay.endpoint} (peer {dht.peer_id}).", flush=True)

        async def stop():
            print("Leaving the swarm...", flush=True)
            if tasks:
                server, announcing = tasks
                announcing.cancel()
                relay.close()
                await server.stop(0.5)

        asyncio.run(until_signalled(start, stop, done, cfg.server.leave_timeout))
    finally:
        dht.shutdown()

"""The relay and the uplink in one process over loopback, in a plaintext run (admission off).

Real gRPC servers and sockets; the DHT is a small fake that lists the relays. The real-process
tests are tests/test_relay.py (TLS, loopback) and tests/test_nat.py (a real NAT).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from peer.config import PeerConfig
from peer.net.relay import RelayService, add_relay
from peer.net.uplink import NoRelay, Uplink

RUN = "unit"


class FakeDHT:
    """Lists the relays' records; nothing else is asked of the DHT here."""

    def __init__(self, peer_id: str, relays: dict[str, RelayService]):
        self.peer_id, self.relays, self.security = peer_id, relays, None

    async def aget(self, key, model, gated=True):
        return {pid: relay.record() for pid, relay in self.relays.items()}


def config(**relay) -> PeerConfig:
    cfg = PeerConfig()
    cfg.network.host = "127.0.0.1"
    for name, value in relay.items():
        setattr(cfg.relay, name, value)
    return cfg


async def serve(cfg: PeerConfig, relay: RelayService | None = None) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    await checker.set("", health_pb2.HealthCheckResponse.SERVING)
    if relay is not None:
        add_relay(server, relay)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    if relay is not None:
        relay.endpoint = f"127.0.0.1:{port}"
    return server, f"127.0.0.1:{port}"


async def check(endpoint: str) -> int:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


def test_served_through_a_relay_then_another_when_it_stops_and_full_relays_refuse():
    async def main():
        cfg = config(reachability="private", dead_after=2.0, keepalive=0.5, max_peers=1, wait=3.0)
        relays = {name: RelayService(cfg, RUN, "127.0.0.1") for name in ("relayA", "relayB")}
        servers = {name: (await serve(cfg, relay))[0] for name, relay in relays.items()}
        own, endpoint = await serve(cfg)
        moved = []

        async def on_moved(new):
            moved.append(new)

        uplink = Uplink(cfg, RUN, FakeDHT("hidden", relays), endpoint, on_moved)
        announced = await uplink.start()
        assert announced != endpoint and uplink.relay in relays
        carrier = relays[uplink.relay]
        assert announced == carrier.attached["hidden"].endpoint
        assert await check(announced) == health_pb2.HealthCheckResponse.SERVING  # through the relay
        assert carrier.bytes_relayed > 0 and carrier.record().relayed == 1

        # a relay carrying relay.max_peers refuses more: the second peer takes the other relay
        other, other_endpoint = await serve(cfg)
        second = Uplink(cfg, RUN, FakeDHT("second", relays), other_endpoint)
        await second.start()
        assert second.relay != uplink.relay
        # with both full, a third finds none within relay.wait
        third_server, third_endpoint = await serve(cfg)
        with pytest.raises(NoRelay):
            await Uplink(cfg, RUN, FakeDHT("third", relays), third_endpoint).start()
        await second.close()

        lost = uplink.relay
        await servers[lost].stop(0)  # the relay goes away: the peer moves within seconds
        for _ in range(100):
            if moved:
                break
            await asyncio.sleep(0.05)
        assert moved and uplink.relay not in ("", lost) and uplink.moves == 1
        assert await check(moved[-1]) == health_pb2.HealthCheckResponse.SERVING
        await uplink.close()
        for server in (*servers.values(), own, other, third_server):
            await server.stop(0)

    asyncio.run(main())


def test_a_reachable_peer_is_told_so_and_uses_no_relay():
    async def main():
        cfg = config()
        relay = RelayService(cfg, RUN, "127.0.0.1")
        relay_server, _ = await serve(cfg, relay)
        own, endpoint = await serve(cfg)
        uplink = Uplink(cfg, RUN, FakeDHT("open", {"relayA": relay}), endpoint)
        assert await uplink.start() == endpoint
        assert uplink.reachable is True and uplink.relay == "" and not relay.attached
        # an endpoint nobody listens on is reported unreachable, with the reason
        reachable, detail = await relay.dial_back("127.0.0.1:1", "nobody")
        assert not reachable and "UNAVAILABLE" in detail
        await uplink.close()
        await own.stop(0)
        await relay_server.stop(0)

    asyncio.run(main())


def test_a_relay_opens_only_the_ports_of_relay_ports_and_refuses_when_none_is_free():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free now: the relay's one port for the peers it carries

    async def main():
        cfg = config(reachability="private", ports=f"{port}-{port}", wait=2.0)
        relay = RelayService(cfg, RUN, "127.0.0.1")
        relay_server, _ = await serve(cfg, relay)
        own, endpoint = await serve(cfg)
        uplink = Uplink(cfg, RUN, FakeDHT("first", {"relayA": relay}), endpoint)
        assert await uplink.start() == f"127.0.0.1:{port}"
        assert await check(f"127.0.0.1:{port}") == health_pb2.HealthCheckResponse.SERVING
        other, other_endpoint = await serve(cfg)
        with pytest.raises(NoRelay):  # the range is used up: refused, and no other relay
            await Uplink(cfg, RUN, FakeDHT("second", {"relayA": relay}), other_endpoint).start()
        assert relay.refused >= 1
        await uplink.close()
        for server in (relay_server, own, other):
            await server.stop(0)

    asyncio.run(main())


def test_one_stranger_s_idle_connections_leave_room_for_everyone_else():
    """A stranger opens relay.max_connections (64) idle TCP connections through a relay to the peer it carries,
    from one address (127.0.0.2): only relay.max_connections_per_host of them are taken, and a caller from
    another address is still carried to the peer."""

    async def main():
        cfg = config(reachability="private", keepalive=0.5, max_connections=64, max_connections_per_host=16)
        relays = {"relay": RelayService(cfg, RUN, "127.0.0.1")}
        relay_server, _ = await serve(cfg, relays["relay"])
        own, endpoint = await serve(cfg)
        uplink = Uplink(cfg, RUN, FakeDHT("hidden", relays), endpoint)
        announced = await uplink.start()
        host, port = announced.rsplit(":", 1)
        stranger = []
        for _ in range(64):
            stranger.append(await asyncio.open_connection(host, int(port), local_addr=("127.0.0.2", 0)))
        carrier = relays["relay"].attached["hidden"]
        for _ in range(100):  # the relay has seen them all (taken or closed)
            if relays["relay"].refused + len(carrier.waiting) + len(carrier.carried) >= 64:
                break
            await asyncio.sleep(0.05)
        assert relays["relay"].refused == 48, relays["relay"].refused
        assert await check(announced) == health_pb2.HealthCheckResponse.SERVING  # from 127.0.0.1
        for _, writer in stranger:
            writer.close()
        await uplink.close()
        for server in (relay_server, own):
            await server.stop(0)

    asyncio.run(main())

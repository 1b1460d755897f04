"""A server's way out when nobody can dial it: find out, attach to a relay, move when the relay dies.

On start (`relay.reachability = auto`) the peer asks a relay (peer.net.relay) to dial back its announced
endpoint. If the relay reaches it, the peer serves directly and never uses a relay. If not, it
attaches to the relay that is best by latency and load, announces the endpoint the relay opened for
it, and carries each connection that arrives there to its own gRPC server over a Tunnel stream.
When the relay's Attach stream breaks or falls silent (`relay.dead_after`), the peer attaches to
another relay and announces the new endpoint: callers see a failed call, re-read the DHT and go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from dht import keys
from dht.errors import UserError
from dht.records import RelayRecord
from peer.config import PeerConfig
from peer.net.client import channel_options
from peer.process.status_lines import say
from protocols import relay_pb2, relay_pb2_grpc

logger = logging.getLogger(__name__)


class NoRelay(UserError, RuntimeError):
    """No relay took this unreachable peer within relay.wait."""


def local_address(host: str, port: int) -> tuple[str, int]:
    """Where this peer's own gRPC server is dialled from inside the machine."""
    return ("127.0.0.1" if host in ("0.0.0.0", "::", "") else host), port


class Uplink:
    def __init__(self, cfg: PeerConfig, run: str, dht, endpoint: str, on_moved=None):
        self.cfg, self.run, self.dht = cfg, run, dht
        self.security = dht.security  # peer.net.security.Security, or None in a plaintext run
        self.direct = endpoint  # this peer's own gRPC endpoint
        self.local = local_address(cfg.network.host, int(endpoint.rsplit(":", 1)[1]))
        self.endpoint = endpoint  # what the peer announces: its own, or the one its relay opened for it
        self.relay = ""  # peer id of the relay that carries it; empty: none
        self.reachable: bool | None = None  # None: not known (no relay to ask)
        self.on_moved = on_moved  # async callable(endpoint), when the announced endpoint changes
        self.moves = 0  # relays moved to after one was lost
        self.bytes = 0  # bytes carried through relays, both ways
        self.banned: dict[str, float] = {}  # relay peer id -> monotonic time it may be chosen again
        self._channels: dict[str, grpc.aio.Channel] = {}  # relay peer id -> channel
        self._call = None
        self._task: asyncio.Task | None = None
        self._tunnels: set[asyncio.Task] = set()
        self.closing = False
        self.relay_offered = None  # peer.net.relay.RelayService this peer offers to others, once announced
        self._offering: asyncio.Task | None = None

    # ---- channels to relays ----------------------------------------------------------------
    def _stub(self, peer: str, endpoint: str) -> relay_pb2_grpc.RelayStub:
        channel = self._channels.get(peer)
        if channel is None:
            options = channel_options(4 * 1024 * 1024)
            if self.security is None:
                channel = grpc.aio.insecure_channel(endpoint, options=options)
            else:
                options.append(("grpc.ssl_target_name_override", self.security.target_name(peer)))
                channel = grpc.aio.secure_channel(endpoint, self.security.channel_credentials(), options=options)
            self._channels[peer] = channel
        return relay_pb2_grpc.RelayStub(channel)

    async def _drop(self, peer: str) -> None:
        channel = self._channels.pop(peer, None)
        if channel is not None:
            with contextlib.suppress(Exception):
                await channel.close(None)

    # ---- choosing ------------------------------------------------------------------------
    async def _ping(self, peer: str, record: RelayRecord) -> tuple[float, relay_pb2.ProbeReply] | None:
        timeout = self.cfg.relay.probe_timeout
        try:
            stub = self._stub(peer, record.endpoint)
            await asyncio.wait_for(self._channels[peer].channel_ready(), timeout)  # the handshake is not latency
            started = time.perf_counter()
            reply = await stub.Probe(relay_pb2.ProbeRequest(run=self.run, peer_id=self.dht.peer_id), timeout=timeout)
            return time.perf_counter() - started, reply
        except (grpc.aio.AioRpcError, TimeoutError, OSError) as e:
            logger.info("relay %s at %s did not answer a ping: %s", peer, record.endpoint, e)
            self.banned[peer] = time.monotonic() + self.cfg.relay.ban_time
            await self._drop(peer)
            return None

    async def candidates(self) -> list[tuple[str, RelayRecord, float]]:
        """Relays that may take this peer, best first: (peer id, record, score: latency x (1 + load))."""
        relay = self.cfg.relay
        try:
            records = await self.dht.aget(keys.relays_key(self.run), RelayRecord)
        except Exception as e:  # the DHT may be busy: no relays known this time, asked again later
            logger.warning("could not read the relays' records: %s", e)
            return []
        now = time.monotonic()
        offers = [
            (pid, r) for pid, r in records.items() if pid != self.dht.peer_id and r.endpoint and r.relayed < r.capacity
        ]
        unbanned = [(pid, r) for pid, r in offers if self.banned.get(pid, 0) <= now]
        offers = unbanned or offers  # a relay that failed is tried again when it is the only one left
        offers.sort(key=lambda item: item[1].relayed / max(item[1].capacity, 1))
        offers = offers[: relay.candidates]
        pings = await asyncio.gather(*(self._ping(pid, r) for pid, r in offers))
        scored = []
        for (pid, record), ping in zip(offers, pings, strict=True):
            if ping is not None and ping[1].relayed < ping[1].capacity:
                rtt, reply = ping
                scored.append((pid, record, rtt * (1 + reply.relayed / max(reply.capacity, 1))))
        scored.sort(key=lambda item: item[2])
        chosen = {pid for pid, *_ in scored}
        for pid, _ in offers:
            if pid not in chosen:  # full now: its channel is not kept
                await self._drop(pid)
        return scored

    # ---- reachability --------------------------------------------------------------------
    async def check(self, relays) -> tuple[bool | None, str, str]:
        """(reachable, which relay said so, why not): asks up to two relays to dial back this peer."""
        detail = ""
        for pid, record, _ in relays[:2]:
            request = relay_pb2.ProbeRequest(run=self.run, endpoint=self.direct, peer_id=self.dht.peer_id)
            try:
                reply = await self._stub(pid, record.endpoint).Probe(request, timeout=self.cfg.relay.probe_timeout * 2)
            except grpc.aio.AioRpcError as e:
                detail = f"{e.code().name}: {e.details()}"
                continue
            return reply.reachable, pid, reply.detail
        return None, "", detail

    async def start(self) -> str:
        """Find out whether this peer can be dialled; attach to a relay if not. The endpoint to announce."""
        mode = self.cfg.relay.reachability
        if mode == "public":
            self.reachable = True
            return self.endpoint
        relays = await self.candidates()
        if mode == "auto":
            if not relays:
                say(
                    f"Could not check whether {self.direct} can be dialled from outside: no peer offers to relay "
                    "(and dial back). Announcing it as it is."
                )
                return self.endpoint
            self.reachable, judge, detail = await self.check(relays)
            if self.reachable is None:
                say(f"Could not check whether {self.direct} can be dialled ({detail}); announcing it.")
                return self.endpoint
            if self.reachable:
                say(f"Reachable at {self.direct}: relay {judge} dialled it back. Serving directly.")
                await self._close_channels()
                return self.endpoint
            say(
                f"Not reachable at {self.direct} from outside (relay {judge} could not dial it: {detail}); "
                'serving through a relay. (Set relay.reachability = "private" to skip this check and keep the '
                "DHT node in client mode too.)"
            )
        else:
            self.reachable = False
        deadline = time.monotonic() + self.cfg.relay.wait
        while not await self._attach_any(relays):
            if time.monotonic() > deadline:
                raise NoRelay(
                    f"this peer cannot be dialled at {self.direct} and no relay took it within "
                    f"{self.cfg.relay.wait:.0f} s (relay.wait); run a relay on a reachable machine "
                    "(peer join ADDR --role relay) or let the coordinator relay (coordinator.relay = true)"
                )
            await asyncio.sleep(1.0)
            relays = await self.candidates()
        self._task = asyncio.create_task(self._keep())
        return self.endpoint

    # ---- attached ------------------------------------------------------------------------
    async def _attach_any(self, relays) -> bool:
        for pid, record, _ in relays:
            stub = self._stub(pid, record.endpoint)
            call = stub.Attach(relay_pb2.AttachRequest(run=self.run, peer_id=self.dht.peer_id))
            try:
                first = await asyncio.wait_for(call.read(), self.cfg.relay.connect_timeout)
                if first is grpc.aio.EOF or not first.endpoint:
                    raise ConnectionError("the relay closed the stream")
            except (grpc.aio.AioRpcError, TimeoutError, ConnectionError) as e:
                call.cancel()
                why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e) or "timeout"
                logger.warning("relay %s did not take this peer: %s", pid, why)
                self.banned[pid] = time.monotonic() + self.cfg.relay.ban_time
                await self._drop(pid)
                continue
            self._call, self.relay, self.endpoint = call, pid, first.endpoint
            for other in [p for p in self._channels if p != pid]:
                await self._drop(other)
            say(f"Serving through relay {pid} at {self.endpoint}.")
            return True
        return False

    async def _follow(self) -> str:
        """Carry the connections the relay announces until its stream ends; why it ended."""
        call, stub = self._call, self._stub(self.relay, "")
        while True:
            try:
                signal = await asyncio.wait_for(call.read(), self.cfg.relay.dead_after)
            except TimeoutError:
                call.cancel()
                return f"no signal for {self.cfg.relay.dead_after:.0f} s"
            except grpc.aio.AioRpcError as e:
                return f"{e.code().name}: {e.details()}"
            if signal is grpc.aio.EOF:
                return "it closed the stream"
            if signal.connection:
                if len(self._tunnels) >= self.cfg.relay.max_connections:
                    continue  # the relay closes it when not carried in time
                task = asyncio.create_task(self._tunnel(stub, signal.connection))
                self._tunnels.add(task)
                task.add_done_callback(self._tunnels.discard)

    async def _keep(self) -> None:
        while True:
            lost, why = self.relay, await self._follow()
            if self.closing:
                return
            self.banned[lost] = time.monotonic() + self.cfg.relay.ban_time
            self.relay, since = "", time.monotonic()
            await self._drop(lost)
            say(f"Relay {lost} is gone ({why}); moving to another relay.")
            while not await self._attach_any(await self.candidates()):
                await asyncio.sleep(1.0)
            self.moves += 1
            say(f"Moved to relay {self.relay} in {time.monotonic() - since:.1f} s.")
            if self.on_moved is not None:
                try:
                    await self.on_moved(self.endpoint)
                except Exception as e:  # announcing must not end the move: the next announcement says it
                    logger.warning("could not announce the new endpoint: %s", e)

    async def _tunnel(self, stub: relay_pb2_grpc.RelayStub, connection: int) -> None:
        """Carry one connection: the relay's side of it to a new connection to this peer's own server."""
        chunk = self.cfg.relay.chunk_bytes
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(*self.local), self.cfg.relay.connect_timeout
            )
        except (OSError, TimeoutError) as e:
            logger.warning("could not reach this peer's own server at %s: %s", self.local, e)
            return

        async def outgoing():
            yield relay_pb2.TunnelChunk(connection=connection)
            with contextlib.suppress(ConnectionError, OSError):
                while data := await reader.read(chunk):
                    self.bytes += len(data)
                    yield relay_pb2.TunnelChunk(data=data)

        call = stub.Tunnel(outgoing())
        try:
            async for item in call:
                self.bytes += len(item.data)
                writer.write(item.data)
                await writer.drain()
        except (grpc.aio.AioRpcError, ConnectionError, OSError) as e:
            logger.debug("tunnel %d ended: %s", connection, e)
        finally:
            call.cancel()
            writer.close()

    def offer(self, relay) -> None:
        """Announce `relay` (this peer's own RelayService, or None) unless this peer cannot be dialled itself."""
        if relay is None:
            return
        if self.reachable is False:
            say("relay.offer: this peer cannot be dialled itself, so it does not relay for others.")
            return
        relay.endpoint, self.relay_offered = self.direct, relay
        self._offering = asyncio.create_task(relay.announce(self.dht))
        say(f"Relaying for peers that cannot be dialled, at {self.direct} (relay.offer).")

    # ---- lifecycle -----------------------------------------------------------------------
    async def _close_channels(self) -> None:
        for peer in list(self._channels):
            await self._drop(peer)

    async def close(self) -> None:
        self.closing = True
        if self.relay_offered is not None:
            self.relay_offered.close()
        tasks = [t for t in (self._task, self._offering, *self._tunnels) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._call is not None:
            self._call.cancel()
        await self._close_channels()

    def levels(self) -> dict:
        """This peer's relay metrics (peer.net.metrics levels)."""
        offered = self.relay_offered.levels() if self.relay_offered is not None else {}
        return {
            **offered,
            "relayed": (
                "gauge",
                "1 when this peer is served through a relay (it cannot be dialled)",
                int(bool(self.relay)),
            ),
            "relay_moves": ("counter", "Relays this peer moved to after losing one", self.moves),
            "relayed_bytes": ("counter", "Bytes of this peer's calls carried through relays, both ways", self.bytes),
        }

"""The relay: carries calls to peers that cannot be dialled (behind NAT) over connections they dial out.

A reachable peer offers to relay (`relay.offer`; the coordinator by `coordinator.relay`; or a peer
that only relays, `peer join ADDR --role relay`). It serves the Relay service of
protocols/relay.proto and announces itself under keys.relays_key with its load.

A peer that cannot be dialled (peer.net.uplink) attaches with a long-lived Attach stream. The relay
listens on a TCP port of its own for that peer and tells it the endpoint, which the peer announces
as its own. Each TCP connection that arrives there is announced on the Attach stream; the peer
opens a Tunnel stream for it and the relay copies the bytes both ways. Those bytes are the
caller's TLS session with the relayed peer (the caller pins the relayed peer's name as for any
server), so the relay forwards what it can neither read nor change, and callers need no change.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dht import keys
from dht.credential import CredentialError
from dht.records import RelayRecord
from peer.config import PeerConfig, port_range
from peer.net.background import LoopThread
from peer.net.cadence import Cadence
from peer.net.client import channel_options
from peer.net.refusal import refuse
from peer.net.serving import announce_host, grpc_server, listen
from protocols import relay_pb2, relay_pb2_grpc
from protocols.failures import Reason

logger = logging.getLogger(__name__)


class _Attachment:
    """One peer this relay carries: the port that listens for it and its connections."""

    def __init__(self, peer: str):
        self.peer = peer
        self.listener: asyncio.Server | None = None
        self.endpoint = ""
        self.signals: asyncio.Queue[int] = asyncio.Queue()  # bounded by relay.max_connections (checked on arrival)
        self.waiting: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}  # announced, not carried
        self.carried: set[asyncio.StreamWriter] = set()
        self.bytes = 0
        self.since = time.time()

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        for _, writer in self.waiting.values():
            writer.close()
        for writer in self.carried:
            writer.close()
        self.waiting.clear()


class RelayService(relay_pb2_grpc.RelayServicer):
    """The relay side. `security` (peer.net.security.Security) or None for a plaintext run (admission off)."""

    def __init__(self, cfg: PeerConfig, run: str, announce_host: str, security=None, role: str = "relay"):
        self.cfg, self.run, self.announce_host, self.security, self.role = cfg, run, announce_host, security, role
        self.attached: dict[str, _Attachment] = {}
        self.bytes_relayed = 0
        self.refused = 0  # attachments and connections refused for a limit
        self.endpoint = ""  # this relay's own gRPC endpoint, set by whoever serves it
        self._ids = itertools.count(1)
        self._rate_mark = (time.monotonic(), 0)
        self.rate = 0.0

    # ---- who calls -----------------------------------------------------------------------
    async def _caller(self, context, claimed: str) -> str:
        if self.security is None:
            if not claimed:
                await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "peer_id: empty (this run has no TLS)")
            return claimed
        certs = context.auth_context().get("x509_pem_cert") or []
        try:  # the guard checked it already; this reads the peer id (a cached lookup)
            return self.security.gate.check(certs[0] if certs else None).peer_id
        except CredentialError as e:
            await refuse(context, grpc.StatusCode.UNAUTHENTICATED, f"credential refused: {e}")

    @property
    def connections(self) -> int:
        return sum(len(a.carried) for a in self.attached.values())

    def _count(self, attachment: _Attachment, n: int) -> None:
        attachment.bytes += n
        self.bytes_relayed += n

    def update_rate(self) -> float:
        now, (then, before) = time.monotonic(), self._rate_mark
        if now - then >= 1.0:
            self.rate = (self.bytes_relayed - before) / (now - then)
            self._rate_mark = (now, self.bytes_relayed)
        return self.rate

    def record(self) -> RelayRecord:
        return RelayRecord(
            endpoint=self.endpoint,
            relayed=len(self.attached),
            capacity=self.cfg.relay.max_peers,
            connections=self.connections,
            bytes_relayed=self.bytes_relayed,
            rate=self.update_rate(),
            role=self.role,
            updated=time.time(),
        )

    # ---- Attach --------------------------------------------------------------------------
    async def Attach(self, request: relay_pb2.AttachRequest, context):
        peer = await self._caller(context, request.peer_id)
        if request.run != self.run:
            await refuse(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this relay serves run '{self.run}', not '{request.run}'",
                Reason.WRONG_RUN,
            )
        old = self.attached.pop(peer, None)
        if old is not None:  # the same peer again (it restarted, or its old stream is not torn down yet)
            old.close()
        if len(self.attached) >= self.cfg.relay.max_peers:
            self.refused += 1
            await refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this relay carries {len(self.attached)} peers already (relay.max_peers)",
            )
        attachment = _Attachment(peer)
        attachment.listener = await self._listen(attachment)
        if attachment.listener is None:
            self.refused += 1
            await refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this relay has no free port left in relay.ports ({self.cfg.relay.ports})",
            )
        port = attachment.listener.sockets[0].getsockname()[1]
        attachment.endpoint = f"{self.announce_host}:{port}"
        self.attached[peer] = attachment
        logger.warning("relaying for %s at %s", peer, attachment.endpoint)
        try:
            yield relay_pb2.RelaySignal(endpoint=attachment.endpoint)
            while not self._revoked(peer):  # a peer revoked while attached is dropped within a keepalive
                try:
                    connection = await asyncio.wait_for(attachment.signals.get(), self.cfg.relay.keepalive)
                except TimeoutError:
                    connection = 0  # a keepalive: the peer knows this relay is alive
                yield relay_pb2.RelaySignal(connection=connection)
        finally:
            if self.attached.get(peer) is attachment:
                del self.attached[peer]
            attachment.close()
            logger.warning("stopped relaying for %s (%.1f MB carried)", peer, attachment.bytes / 1e6)

    def _revoked(self, peer: str) -> bool:
        return self.security is not None and peer in self.security.gate.revoked

    async def _listen(self, attachment: _Attachment) -> asyncio.Server | None:
        """The listener for one carried peer: on a free port of `relay.ports`, or any free one; None if none is."""
        host = self.cfg.network.host or None
        for port in port_range(self.cfg.relay.ports) or [0]:
            try:
                return await asyncio.start_server(lambda r, w: self._arrived(attachment, r, w), host=host, port=port)
            except OSError:
                continue  # taken (by another carried peer, or anything else on this machine)
        return None

    async def _arrived(self, attachment: _Attachment, reader, writer) -> None:
        """A connection for the attached peer: announce it; close it if the peer does not carry it in time."""
        relay = self.cfg.relay
        if self.attached.get(attachment.peer) is not attachment or self._revoked(attachment.peer):
            writer.close()
            return
        if len(attachment.waiting) + len(attachment.carried) >= relay.max_connections:
            self.refused += 1
            logger.info("closed a connection for %s: relay.max_connections reached", attachment.peer)
            writer.close()
            return
        host = _host_of(writer)
        open_ones = [w for _, w in attachment.waiting.values()] + list(attachment.carried)
        if sum(1 for w in open_ones if _host_of(w) == host) >= relay.max_connections_per_host:
            self.refused += 1
            logger.info("closed a connection from %s for %s: relay.max_connections_per_host", host, attachment.peer)
            writer.close()
            return
        connection = next(self._ids)
        attachment.waiting[connection] = (reader, writer)
        attachment.signals.put_nowait(connection)
        await asyncio.sleep(relay.connect_timeout)
        if attachment.waiting.pop(connection, None) is not None:
            logger.info(
                "closed connection %d for %s: not carried within %.0f s",
                connection,
                attachment.peer,
                relay.connect_timeout,
            )
            writer.close()

    # ---- Tunnel --------------------------------------------------------------------------
    async def Tunnel(self, request_iterator, context):
        try:
            first = await asyncio.wait_for(anext(request_iterator), self.cfg.relay.connect_timeout)
        except (StopAsyncIteration, TimeoutError):
            await refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, "a tunnel starts with a chunk naming its connection"
            )
        # connection numbers are unique on this relay; with TLS, only the peer it arrived for may carry it
        attachment = next((a for a in self.attached.values() if first.connection in a.waiting), None)
        if attachment is None or (self.security is not None and attachment.peer != await self._caller(context, "")):
            await refuse(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"connection {first.connection} is not waiting at this relay for the caller",
            )
        reader, writer = attachment.waiting.pop(first.connection)
        attachment.carried.add(writer)

        async def to_caller():  # the relayed peer's bytes, out to the caller
            try:
                async for chunk in request_iterator:
                    if chunk.data:
                        writer.write(chunk.data)
                        self._count(attachment, len(chunk.data))
                        await writer.drain()
            finally:
                writer.close()  # the peer's side ended: so does the caller's connection (and the read below)

        sending = asyncio.create_task(to_caller())
        if first.data:
            writer.write(first.data)
        try:
            while not sending.done():
                data = await reader.read(self.cfg.relay.chunk_bytes)
                if not data:
                    break  # the caller closed its connection
                self._count(attachment, len(data))
                yield relay_pb2.TunnelChunk(data=data)
        except (ConnectionError, OSError):
            pass
        finally:
            sending.cancel()
            with contextlib.suppress(BaseException):
                await sending
            attachment.carried.discard(writer)
            writer.close()

    # ---- Probe ---------------------------------------------------------------------------
    async def Probe(self, request: relay_pb2.ProbeRequest, context) -> relay_pb2.ProbeReply:
        peer = await self._caller(context, request.peer_id)
        reply = relay_pb2.ProbeReply(relayed=len(self.attached), capacity=self.cfg.relay.max_peers)
        if request.endpoint:
            reply.reachable, reply.detail = await self.dial_back(request.endpoint, peer)
        return reply

    async def dial_back(self, endpoint: str, peer: str) -> tuple[bool, str]:
        """Whether the gRPC server of `peer` answers at `endpoint` (over TLS: and proves it is that peer)."""
        options = channel_options(4 * 1024 * 1024)
        security = self.security
        if security is None:
            channel = grpc.aio.insecure_channel(endpoint, options=options)
        else:
            options.append(("grpc.ssl_target_name_override", security.target_name(peer)))
            channel = grpc.aio.secure_channel(endpoint, security.channel_credentials(), options=options)
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.cfg.relay.probe_timeout)
            return True, ""
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return False, f"{e.code().name}: {e.details()}"
            return True, ""  # it answered (with an error of its own): reachable
        finally:
            await channel.close()

    # ---- presence ------------------------------------------------------------------------
    async def announce(self, dht) -> None:
        """Announce this relay's offer and load, until cancelled: every announce period while its load changes,
        seldom at rest (peer.net.cadence)."""
        cadence, last = Cadence(self.cfg.network), None
        while True:
            record = self.record()
            load = (record.endpoint, record.relayed, record.capacity, record.connections)
            changed = load != last
            ttl = cadence.ttl(changed)
            try:
                if await dht.astore(keys.relays_key(self.run), record, ttl):
                    cadence.stored(ttl, changed)
                    last = load
            except Exception as e:  # the relay's announcements must not stop: tried again next period
                logger.warning("could not announce the relay: %s", e)
            await asyncio.sleep(cadence.period)

    def close(self) -> None:
        for attachment in list(self.attached.values()):
            attachment.close()
        self.attached.clear()

    def levels(self) -> dict:
        """This relay's metrics (peer.net.metrics levels)."""
        return {
            "relay_peers": ("gauge", "Unreachable peers this peer relays for", len(self.attached)),
            "relay_connections": ("gauge", "Connections this peer forwards for relayed peers", self.connections),
            "relay_bytes": ("counter", "Bytes forwarded for relayed peers, both ways", self.bytes_relayed),
            "relay_refused": ("counter", "Attachments and connections refused for relay.max_*", self.refused),
        }


def offered_relay(cfg: PeerConfig, run: str, security, role: str) -> RelayService | None:
    """The relay a server adds to its gRPC server when it offers to relay (`relay.offer`), else None."""
    if not cfg.relay.offer:
        return None
    return RelayService(cfg, run, announce_host(cfg.network.host, cfg.network.announce_host), security, role)


def add_relay(server: grpc.aio.Server, relay: RelayService) -> None:
    relay_pb2_grpc.add_RelayServicer_to_server(relay, server)


class RelayThread:
    """A relay with a gRPC server of its own, on a thread of its own (the coordinator's loop is not asyncio)."""

    def __init__(self, cfg: PeerConfig, run: str, dht, port: int, role: str = "coordinator"):
        self.cfg, self.dht, self.port = cfg, dht, port
        host = announce_host(cfg.network.host, cfg.network.announce_host)
        self.relay = RelayService(cfg, run, host, dht.security, role)
        self._thread = LoopThread("relay")
        self._server: grpc.aio.Server | None = None

    async def _serve(self) -> None:
        server = grpc_server(self.cfg, self.dht.security)
        add_relay(server, self.relay)
        port = listen(server, f"{self.cfg.network.host}:{self.port}", self.dht.security)
        await server.start()
        self._server = server
        self.relay.endpoint = f"{self.relay.announce_host}:{port}"
        self._announce = asyncio.ensure_future(self.relay.announce(self.dht))

    def start(self, timeout: float = 30.0) -> str:
        """Serve; the relay's endpoint. OSError when its server cannot start."""
        self._thread.start(self._serve, timeout)
        return self.relay.endpoint

    def stop(self) -> None:
        async def stop():
            self._announce.cancel()
            self.relay.close()
            await self._server.stop(0.5)

        if self._server is not None:
            with contextlib.suppress(Exception):
                self._thread.call(stop())
        self._thread.stop()


def _host_of(writer) -> str:
    """The address a relayed connection came from ("" if not known)."""
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if peer else ""

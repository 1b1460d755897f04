"""gRPC client of the stage service: channels by endpoint, every call with a deadline, large messages streamed."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from typing import Any

import grpc
import torch

from protocols import codec, expert_pb2, framing, stage_pb2, stage_pb2_grpc
from protocols.failures import reason_of

SERVICE = "swarmtrain.Stage"
EXPERT_SERVICE = "swarmtrain.Expert"
AVERAGE_METHOD = "/swarmtrain.Averaging/Average"  # replicas' all-reduce (peer.server.allreduce)

GRPC_OPTIONS_BASE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


SERVER_OPTIONS_BASE = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        *SERVER_OPTIONS_BASE,
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        *GRPC_OPTIONS_BASE,
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


async def refuses_connections(endpoint: str, timeout: float) -> bool:
    """Whether nothing listens at `endpoint` (host:port) now: a TCP connect refused, so the process is gone.

    A call that failed without a reason (protocols.failures) is told apart this way, not by reading
    gRPC's message; a connect that succeeds, times out or fails otherwise says nothing of the kind.
    """
    host, _, port = endpoint.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError, ValueError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


async def gone_after(error: grpc.aio.AioRpcError, endpoint: str, timeout: float) -> bool:
    """Whether the peer of a failed call is gone: the call failed UNAVAILABLE without a reason (so no handler
    of the peer refused it) and nothing listens at its endpoint any more."""
    if reason_of(error) is not None or error.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    return await refuses_connections(endpoint, timeout)


class StageClient:
    """Talks to stage servers. Keeps at most `max_channels` open channels (least recently used go first).

    Calls take and return `(message, payloads)`: tensors whose bytes travel outside the message
    (see protocols.framing). Messages up to `stream_bytes` go as one unary call, larger ones as a
    framed stream of chunks of at most `chunk_bytes`.
    """

    def __init__(
        self,
        chunk_bytes: int,
        max_message_bytes: int,
        max_tensor_elements: int | None = None,
        max_channels: int = 64,
        stream_bytes: int | None = None,
        security=None,
    ):
        self.security = security  # peer.net.security.Security: TLS with the peer's credential; None: plaintext
        self.chunk_bytes, self.max_message_bytes, self.max_channels = chunk_bytes, max_message_bytes, max_channels
        self.stream_bytes = chunk_bytes if stream_bytes is None else stream_bytes  # above this, a framed stream
        self.max_tensor_elements = max_tensor_elements
        self._channels: OrderedDict[tuple, tuple[grpc.aio.Channel, stage_pb2_grpc.StageStub]] = OrderedDict()

    @classmethod
    def for_server(cls, server_cfg, security=None) -> StageClient:
        """A client with a peer's limits (`ServerConfig`: chunk, message, tensor and stream sizes)."""
        return cls(
            server_cfg.chunk_bytes,
            server_cfg.max_message_bytes,
            server_cfg.max_tensor_elements,
            stream_bytes=server_cfg.stream_bytes,
            security=security,
        )

    def _channel(self, endpoint: str, peer: str | None = None) -> tuple[grpc.aio.Channel, stage_pb2_grpc.StageStub]:
        """A channel to `endpoint`; over TLS, pinned to `peer`, the owner of the record the caller chose (a new
        channel when the peer or this peer's certificate changes). Without `peer` no server can pass the
        handshake: the name is never looked up by endpoint (any admitted record may name any endpoint)."""
        security = self.security
        name = security.target_name(peer) if security is not None else ""
        key = (endpoint, name, security.generation if security is not None else 0)
        if key in self._channels:
            self._channels.move_to_end(key)
            return self._channels[key]
        options = channel_options(self.max_message_bytes)
        if security is None:
            channel = grpc.aio.insecure_channel(endpoint, options=options)
        else:
            options.append(("grpc.ssl_target_name_override", name))
            channel = grpc.aio.secure_channel(endpoint, security.channel_credentials(), options=options)
        self._channels[key] = (channel, stage_pb2_grpc.StageStub(channel))
        while len(self._channels) > self.max_channels:
            _, (old, _) = self._channels.popitem(last=False)
            asyncio.ensure_future(old.close())
        return self._channels[key]

    def _unary(self, endpoint: str, path: str, response_type, peer: str | None):
        channel, _ = self._channel(endpoint, peer)
        return channel.unary_unary(
            path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=response_type.FromString
        )

    async def _call(
        self,
        endpoint: str,
        method: str,
        request,
        payloads,
        response_type,
        timeout: float,
        peer: str | None,
        service: str = SERVICE,
    ):
        payloads = dict(payloads or {})
        channel, _ = self._channel(endpoint, peer)
        if framing.size(request, payloads) <= self.stream_bytes:
            call = self._unary(endpoint, f"/{service}/{method}", response_type, peer)
            return await call(framing.inline(request, payloads), timeout=timeout), {}
        if any(t.data for _, t in framing.tensor_paths(request)):
            header = type(request)()  # a copy: the caller's request stays whole for a retry
            header.CopyFrom(request)
            for path, tensor in framing.tensor_paths(header):  # tensors still inline go out of band too
                if tensor.data and path not in payloads:
                    payloads[path] = tensor.data
                tensor.data = b""
            request = header
        call = channel.stream_stream(f"/{service}/{method}Stream")(
            framing.frames(request, payloads, self.chunk_bytes), timeout=timeout
        )
        return await framing.read(call, response_type, self.max_message_bytes, self.max_tensor_elements)

    async def forward(
        self, endpoint: str, request: stage_pb2.ForwardRequest, payloads=None, timeout: float = 30.0, peer=None
    ):
        return await self._call(endpoint, "Forward", request, payloads, stage_pb2.ForwardResponse, timeout, peer)

    async def backward(
        self, endpoint: str, request: stage_pb2.BackwardRequest, payloads=None, timeout: float = 30.0, peer=None
    ):
        return await self._call(endpoint, "Backward", request, payloads, stage_pb2.BackwardResponse, timeout, peer)

    async def expert_forward(
        self, endpoint: str, request: expert_pb2.ExpertForwardRequest, payloads, timeout: float, peer=None
    ):
        response_type = expert_pb2.ExpertForwardResponse
        return await self._call(endpoint, "Forward", request, payloads, response_type, timeout, peer, EXPERT_SERVICE)

    async def expert_backward(
        self, endpoint: str, request: expert_pb2.ExpertBackwardRequest, payloads, timeout: float, peer=None
    ):
        response_type = expert_pb2.ExpertBackwardResponse
        return await self._call(endpoint, "Backward", request, payloads, response_type, timeout, peer, EXPERT_SERVICE)

    async def info(self, endpoint: str, timeout: float, expert: str = "", peer=None) -> stage_pb2.InfoResponse:
        """A stage server's Info, or with `expert`, that expert's on an expert host."""
        service = EXPERT_SERVICE if expert else SERVICE
        call = self._unary(endpoint, f"/{service}/Info", stage_pb2.InfoResponse, peer)
        return await call(stage_pb2.InfoRequest(expert=expert), timeout=timeout)

    async def round(
        self,
        endpoint: str,
        run_id: str,
        stage: int,
        epoch: int,
        timeout: float,
        expert: str = "",
        peer=None,
        inviter: str = "",
    ) -> stage_pb2.RoundResponse:
        """Invite a replica (`peer`) to the round for `epoch`; `inviter`: our own peer id."""
        request = stage_pb2.RoundRequest(run_id=run_id, stage=stage, epoch=epoch, expert=expert, inviter=inviter)
        service = EXPERT_SERVICE if expert else SERVICE
        call = self._unary(endpoint, f"/{service}/Round", stage_pb2.RoundResponse, peer)
        return await call(request, timeout=timeout)

    async def progress(
        self, endpoint: str, request: stage_pb2.ProgressRequest, timeout: float, peer=None
    ) -> stage_pb2.ProgressResponse:
        """Push our record to a partner replica (`peer`); its own comes back (peer.server.replica_push)."""
        service = EXPERT_SERVICE if request.expert else SERVICE
        call = self._unary(endpoint, f"/{service}/Progress", stage_pb2.ProgressResponse, peer)
        return await call(request, timeout=timeout)

    async def get_state(
        self,
        endpoint: str,
        run_id: str,
        stage: int,
        timeout: float,
        shard: int = 0,
        num_shards: int = 1,
        epoch: int | None = None,
        expert: str = "",
        peer: str | None = None,
    ) -> tuple[dict, dict[str, torch.Tensor]]:
        """A stage's (or an expert's) state, part `shard` of `num_shards`, only at `epoch` when given."""
        channel, _ = self._channel(endpoint, peer)
        request = stage_pb2.StateRequest(run_id=run_id, stage=stage, shard=shard, num_shards=num_shards, expert=expert)
        if epoch is not None:
            request.epoch = epoch
        request = request.SerializeToString()
        service = EXPERT_SERVICE if expert else SERVICE
        call = channel.unary_stream(f"/{service}/GetState")(request, timeout=timeout)
        response, payloads = await framing.read(call, stage_pb2.StateResponse, self.max_message_bytes)
        tensors = {
            item.name: codec.decode(item.tensor, payload=payloads.get(f"tensors.{i}.tensor"))
            for i, item in enumerate(response.tensors)
        }
        return json.loads(response.metadata_json), tensors

    def average(self, endpoint: str, peer: str, timeout: float):
        """An open bidirectional Average call to the replica `peer` (peer.server.allreduce): frames as bytes
        (protocols.averaging_frames), so a piece's data is never copied through protobuf."""
        channel, _ = self._channel(endpoint, peer)
        return channel.stream_stream(AVERAGE_METHOD)(timeout=timeout)

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()

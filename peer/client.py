"""gRPC client of the stage service: channels by endpoint, every call with a deadline, large messages streamed."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import grpc
import torch

from protocols import chunking, codec, stage_pb2, stage_pb2_grpc

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


class StageClient:
    """Talks to stage servers. Keeps at most `max_channels` open channels (least recently used go first)."""

    def __init__(self, chunk_bytes: int, max_message_bytes: int, max_channels: int = 64):
        self.chunk_bytes, self.max_message_bytes, self.max_channels = chunk_bytes, max_message_bytes, max_channels
        self._channels: OrderedDict[str, tuple[grpc.aio.Channel, stage_pb2_grpc.StageStub]] = OrderedDict()

    def _stub(self, endpoint: str) -> stage_pb2_grpc.StageStub:
        if endpoint in self._channels:
            self._channels.move_to_end(endpoint)
            return self._channels[endpoint][1]
        channel = grpc.aio.insecure_channel(endpoint, options=channel_options(self.max_message_bytes))
        stub = stage_pb2_grpc.StageStub(channel)
        self._channels[endpoint] = (channel, stub)
        while len(self._channels) > self.max_channels:
            _, (old, _) = self._channels.popitem(last=False)
            old.close()  # coroutine; closing in the background is enough
        return stub

    async def _unary_or_stream(self, unary, streaming, request, response_type, timeout: float):
        serialized_size = request.ByteSize()
        if serialized_size <= self.chunk_bytes:
            return await unary(request, timeout=timeout)
        call = streaming(chunking.split(request.SerializeToString(), self.chunk_bytes), timeout=timeout)
        data = await chunking.join(call, self.max_message_bytes)
        return response_type.FromString(data)

    async def forward(
        self, endpoint: str, request: stage_pb2.ForwardRequest, timeout: float
    ) -> stage_pb2.ForwardResponse:
        stub = self._stub(endpoint)
        return await self._unary_or_stream(
            stub.Forward, stub.ForwardStream, request, stage_pb2.ForwardResponse, timeout
        )

    async def backward(
        self, endpoint: str, request: stage_pb2.BackwardRequest, timeout: float
    ) -> stage_pb2.BackwardResponse:
        stub = self._stub(endpoint)
        return await self._unary_or_stream(
            stub.Backward, stub.BackwardStream, request, stage_pb2.BackwardResponse, timeout
        )

    async def info(self, endpoint: str, timeout: float) -> stage_pb2.InfoResponse:
        return await self._stub(endpoint).Info(stage_pb2.InfoRequest(), timeout=timeout)

    async def round(
        self, endpoint: str, run_id: str, stage: int, epoch: int, timeout: float
    ) -> stage_pb2.RoundResponse:
        request = stage_pb2.RoundRequest(run_id=run_id, stage=stage, epoch=epoch)
        return await self._stub(endpoint).Round(request, timeout=timeout)

    async def get_state(
        self, endpoint: str, run_id: str, stage: int, timeout: float
    ) -> tuple[dict, dict[str, torch.Tensor]]:
        call = self._stub(endpoint).GetState(stage_pb2.StateRequest(run_id=run_id, stage=stage), timeout=timeout)
        response = stage_pb2.StateResponse.FromString(await chunking.join(call, self.max_message_bytes))
        tensors = {item.name: codec.decode(item.tensor) for item in response.tensors}
        return json.loads(response.metadata_json), tensors

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()

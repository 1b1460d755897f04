"""gRPC handlers of the stage service: decode, check, run on the torch thread, encode.

Bad input never takes the server down: it gets INVALID_ARGUMENT (malformed tensors, wrong
shapes), FAILED_PRECONDITION (wrong run or stage) or RESOURCE_EXHAUSTED (too many requests, too
large a message), each with a message that names the problem.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import grpc

from peer.runtime import InputError
from protocols import chunking, codec, stage_pb2, stage_pb2_grpc, tensor_pb2

if TYPE_CHECKING:
    from peer.server import StageServer

logger = logging.getLogger(__name__)


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, server: StageServer):
        self.server = server
        self.runtime = server.runtime
        self.limits = server.cfg.server

    # ---- helpers --------------------------------------------------------------------------
    def _check_route(self, run_id: str, stage: int) -> None:
        if run_id != self.server.run_id:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this server belongs to run {self.server.run_id!r}, not {run_id!r}",
            )
        if stage != self.server.stage:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION, f"this server serves stage {self.server.stage}, not stage {stage}"
            )
        if self.server.leaving:
            raise _Refused(grpc.StatusCode.UNAVAILABLE, "this server is leaving the swarm")

    def _decode(self, message: tensor_pb2.Tensor, field: str, present: bool):
        if not present:
            return None
        try:
            return codec.decode(message, max_elements=self.limits.max_tensor_elements)
        except codec.TensorDecodeError as e:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {e}") from None

    async def _guarded(self, handler, request, context: grpc.aio.ServicerContext):
        if self.server.inflight >= self.limits.max_concurrent_requests:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server busy: {self.server.inflight} requests in flight (limit {self.limits.max_concurrent_requests})",
            )
        self.server.inflight += 1
        try:
            return await handler(request)
        except _Refused as e:
            await context.abort(e.code, e.message)
        except InputError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            self.server.inflight -= 1

    async def _parse_stream(self, request_iterator, message_type, context):
        try:
            data = await chunking.join(request_iterator, self.limits.max_message_bytes)
            return message_type.FromString(data)
        except chunking.MessageTooLarge as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Exception as e:  # DecodeError and friends
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"streamed request is not a valid {message_type.__name__}: {e}"
            )

    def _chunks(self, response):
        return chunking.split(response.SerializeToString(), self.limits.chunk_bytes)

    # ---- forward / backward ---------------------------------------------------------------
    async def _forward(self, request: stage_pb2.ForwardRequest) -> stage_pb2.ForwardResponse:
        self._check_route(request.run_id, request.stage)
        inputs = self._decode(request.inputs, "inputs", request.HasField("inputs"))
        if inputs is None:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "inputs: missing")
        targets = self._decode(request.targets, "targets", request.HasField("targets"))
        epoch = self.runtime.epoch
        result = await self.server.run_torch(self.runtime.forward, request.uid, inputs, targets, request.train)
        if targets is not None:
            return stage_pb2.ForwardResponse(has_loss=True, loss=float(result), epoch=epoch)
        return stage_pb2.ForwardResponse(outputs=codec.encode(result, request.output_codec), epoch=epoch)

    async def _backward(self, request: stage_pb2.BackwardRequest) -> stage_pb2.BackwardResponse:
        self._check_route(request.run_id, request.stage)
        inputs = self._decode(request.inputs, "inputs", request.HasField("inputs"))
        if inputs is None:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "inputs: missing")
        grad_outputs = self._decode(request.grad_outputs, "grad_outputs", request.HasField("grad_outputs"))
        targets = self._decode(request.targets, "targets", request.HasField("targets"))
        grad_inputs, loss, epoch = await self.server.backward(request.uid, inputs, grad_outputs, targets)
        response = stage_pb2.BackwardResponse(epoch=epoch)
        if grad_inputs is not None:
            response.grad_inputs.CopyFrom(codec.encode(grad_inputs, request.output_codec))
        if loss is not None:
            response.has_loss, response.loss = True, loss
        return response

    async def Forward(self, request, context):
        return await self._guarded(self._forward, request, context)

    async def Backward(self, request, context):
        return await self._guarded(self._backward, request, context)

    async def ForwardStream(self, request_iterator, context):
        request = await self._parse_stream(request_iterator, stage_pb2.ForwardRequest, context)
        response = await self._guarded(self._forward, request, context)
        for chunk in self._chunks(response):
            yield chunk

    async def BackwardStream(self, request_iterator, context):
        request = await self._parse_stream(request_iterator, stage_pb2.BackwardRequest, context)
        response = await self._guarded(self._backward, request, context)
        for chunk in self._chunks(response):
            yield chunk

    # ---- info and state -------------------------------------------------------------------
    async def Info(self, request, context):
        rt = self.runtime
        history = [
            stage_pb2.StepFingerprint(epoch=f.epoch, samples=f.samples, values=f.values) for f in list(rt.history)
        ]
        return stage_pb2.InfoResponse(
            run_id=self.server.run_id,
            stage=self.server.stage,
            peer_id=self.server.dht.peer_id,
            epoch=rt.epoch,
            samples_accumulated=rt.samples_accumulated,
            samples_stepped=rt.samples_stepped,
            throughput=rt.throughput,
            load=self.server.inflight,
            history=history,
        )

    async def Round(self, request: stage_pb2.RoundRequest, context):
        try:
            self._check_route(request.run_id, request.stage)
        except _Refused as e:
            await context.abort(e.code, e.message)
        joining = self.server.join_round(request.epoch)
        return stage_pb2.RoundResponse(joining=joining, epoch=self.runtime.epoch)

    async def GetState(self, request: stage_pb2.StateRequest, context):
        try:
            self._check_route(request.run_id, request.stage)
        except _Refused as e:
            await context.abort(e.code, e.message)
        if self.server.inflight >= self.limits.max_concurrent_requests:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "server busy: too many requests in flight")
        self.server.inflight += 1
        try:
            metadata, tensors = await self.server.run_torch(self.runtime.snapshot)
        finally:
            self.server.inflight -= 1
        response = stage_pb2.StateResponse(metadata_json=json.dumps(metadata, sort_keys=True))
        for name, tensor in tensors.items():
            response.tensors.add(name=name, tensor=codec.encode(tensor))
        for chunk in self._chunks(response):
            yield chunk

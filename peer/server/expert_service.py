"""gRPC handlers of the expert service: check, queue for the expert's batch, encode.

Bad input never takes the host down: an unknown expert gets NOT_FOUND, malformed or misshapen
tensors INVALID_ARGUMENT, too many tokens or requests RESOURCE_EXHAUSTED, a call for another run
FAILED_PRECONDITION, each with a message naming the problem.
"""

from __future__ import annotations

import grpc

from peer.model.expert import ExpertInputError, MissingInputs
from peer.model.runtime import Late
from peer.net.refusal import Refused
from peer.server.replica import Replica
from peer.server.servicer import ServicerBase
from protocols import codec, expert_pb2, expert_pb2_grpc
from protocols.failures import Reason


class ExpertServicer(ServicerBase, expert_pb2_grpc.ExpertServicer):
    SERVICE = "swarmtrain.Expert"
    FORWARD = (expert_pb2.ExpertForwardRequest, expert_pb2.ExpertForwardResponse)
    BACKWARD = (expert_pb2.ExpertBackwardRequest, expert_pb2.ExpertBackwardResponse)

    def __init__(self, host):
        """`host` is the process's ExpertHost (peer.server.expert_host), which imports this module."""
        super().__init__(host, host.cfg.server)
        self.host = host

    def _described(self, expert: str) -> Replica:
        replica = self.host.replicas.get(expert)
        if replica is None:
            hosted = ", ".join(self.host.replicas)
            raise Refused(grpc.StatusCode.NOT_FOUND, f"expert {expert!r} is not hosted here (hosted: {hosted})")
        return replica

    def _replica(self, run_id: str, stage: int, expert: str) -> Replica:
        self._check_run(run_id)
        return self._described(expert)

    def _tokens(self, request, field: str, payloads: dict, replica: Replica):
        tensor = self._decode(getattr(request, field), field, request.HasField(field), payloads)
        if tensor is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: missing")
        limit = self.host.cfg.experts.max_request_tokens
        if tensor.dim() >= 1 and tensor.shape[0] > limit:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{field}: {tensor.shape[0]} tokens in one request; this host takes at most {limit} "
                "(experts.max_request_tokens)",
                Reason.BAD_INPUT,  # never fits here, whenever it is sent
            )
        try:
            replica.runtime.check(tensor, field)
        except ExpertInputError as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return tensor

    async def _forward(self, request: expert_pb2.ExpertForwardRequest, payloads: dict, deadline: float | None):
        replica = self._replica(request.run_id, 0, request.expert)
        inputs = self._tokens(request, "inputs", payloads, replica)
        outputs, epoch = await self.host.forward(request.expert, request.uid, inputs, request.train, deadline)
        if outputs is None:
            raise Late("the request's deadline passed while it waited")
        header, payload = codec.encode_payload(outputs, request.output_codec, self.block_size)
        return expert_pb2.ExpertForwardResponse(outputs=header, epoch=epoch), {"outputs": payload}

    async def _backward(self, request: expert_pb2.ExpertBackwardRequest, payloads: dict, deadline: float | None):
        replica = self._replica(request.run_id, 0, request.expert)
        # the inputs may be left out when this host did the forward: it uses the ones it kept
        inputs = self._tokens(request, "inputs", payloads, replica) if request.HasField("inputs") else None
        grad_outputs = self._tokens(request, "grad_outputs", payloads, replica)
        if inputs is not None and grad_outputs.shape != inputs.shape:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"grad_outputs: shape {list(grad_outputs.shape)} differs from inputs {list(inputs.shape)}",
            )
        if request.samples < 1:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "samples: the caller's micro-batch size must be >= 1")
        most = self.host.spec.training.micro_batch_size  # the run's: a caller's claim weighs no more (clip, step)
        if request.samples > most:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"samples: {request.samples}, more than the run's training.micro_batch_size ({most})",
            )
        result = await self.host.backward(request.expert, request.uid, inputs, grad_outputs, request.samples)
        if isinstance(result, MissingInputs):
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(result), Reason.MISSING_INPUTS)
        if isinstance(result, ExpertInputError):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(result))
        grad_inputs, epoch, seq, incarnation, stepped_seq = result
        header, payload = codec.encode_payload(grad_inputs, request.output_codec, self.block_size)
        response = expert_pb2.ExpertBackwardResponse(
            grad_inputs=header, epoch=epoch, seq=seq, incarnation=incarnation, stepped_seq=stepped_seq
        )
        return response, {"grad_inputs": payload}

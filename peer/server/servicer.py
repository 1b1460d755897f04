"""gRPC handlers of the stage service: decode, check, run on the torch thread, encode.

Bad input never takes the server down: it gets INVALID_ARGUMENT (malformed tensors, wrong
shapes), FAILED_PRECONDITION (wrong run or stage) or RESOURCE_EXHAUSTED (too many requests, too
large a message), each with a message that names the problem.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

import grpc
from google.protobuf.message import DecodeError

from peer.model.moe import ExpertsUnavailable
from peer.model.part import BadGradient
from peer.model.part_state import shard_request_error
from peer.model.runtime import InputError, Late, RankDied
from peer.net.guard import CALLER
from peer.net.refusal import Refused, refuse
from peer.server.replica import Replica
from protocols import codec, framing, stage_pb2, stage_pb2_grpc, tensor_pb2
from protocols.averaging_frames import first_header
from protocols.failures import Reason

logger = logging.getLogger(__name__)
AVERAGING_SERVICE = "swarmtrain.Averaging"  # replicas' all-reduce (protocols/averaging.proto)


class ServicerBase:
    """What the stage and expert services share: limits, decoding, framing, Info/Round/GetState of a replica.

    `owner` is the process's server (a StageServer or an ExpertHost): it counts `inflight`
    requests and says when it is `leaving`.
    """

    SERVICE = ""  # the gRPC service name
    FORWARD: tuple = ()  # (request, response) message types of Forward
    BACKWARD: tuple = ()  # and of Backward

    def __init__(self, owner, limits):
        self.server = owner
        self.limits = limits
        self.block_size = owner.spec.compression.block_size  # int8 outputs: elements per scale
        self._held_by: dict[str, int] = {}  # caller -> bytes of request tensors its running requests hold

    async def _forward(self, request, payloads: dict, deadline: float | None):
        """(response, payloads) of a forward; the subclass's work."""
        raise NotImplementedError

    async def _backward(self, request, payloads: dict, deadline: float | None):
        raise NotImplementedError

    async def Forward(self, request, context):
        return framing.inline(*await self._guarded(self._forward, request, {}, context))

    async def Backward(self, request, context):
        return framing.inline(*await self._guarded(self._backward, request, {}, context))

    async def ForwardStream(self, request_iterator, context):
        header = await self._read_header(request_iterator, self.FORWARD[0], context)
        for frame in self._frames(*await self._guarded(self._forward, header.message, header, context)):
            yield frame

    async def BackwardStream(self, request_iterator, context):
        header = await self._read_header(request_iterator, self.BACKWARD[0], context)
        for frame in self._frames(*await self._guarded(self._backward, header.message, header, context)):
            yield frame

    def _replica(self, run_id: str, stage: int, expert: str) -> Replica:
        """The replica a request names; Refused when this server does not hold it or is leaving."""
        raise NotImplementedError

    def _described(self, expert: str) -> Replica:
        """The replica an Info request names (answered while leaving too)."""
        raise NotImplementedError

    def _state_of(self, run_id: str, stage: int, expert: str) -> Replica:
        """The replica a state request names, served while leaving too: the last server of a part hands its
        state over (to the coordinator's checkpoint, or a joiner) before it goes (peer.server.handover)."""
        self._check_run(run_id, leaving=True)
        replica = self._described(expert)
        if replica.stage != stage:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"this server holds stage {replica.stage}, not {stage}")
        return replica

    def _check_run(self, run_id: str, leaving: bool = False) -> None:
        """The request is for this server's run, and (unless `leaving` is allowed) the server is not leaving."""
        if run_id != self.server.run_id:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this server belongs to run {self.server.run_id!r}, not {run_id!r}",
                Reason.WRONG_RUN,
            )
        if self.server.leaving and not leaving:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "this server is leaving the swarm", Reason.LEAVING)

    def _decode(self, message: tensor_pb2.Tensor, field: str, present: bool, payloads: dict):
        if not present:
            return None
        try:
            return codec.decode(message, max_elements=self.limits.max_tensor_elements, payload=payloads.get(field))
        except codec.TensorDecodeError as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {e}") from None

    async def _check_uid(self, request, context) -> None:
        """A request's uid is kept in the dedup and forward caches: its length has a bound."""
        uid = getattr(request, "uid", "")
        if len(uid) > self.limits.max_uid_length:
            await refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"uid: {len(uid)} characters, more than server.max_uid_length ({self.limits.max_uid_length})",
                Reason.BAD_INPUT,
            )

    async def _guarded(self, handler, request, payloads, context: grpc.aio.ServicerContext):
        """Run `handler` within the limits: requests in flight, and bytes of request tensors held, in all and
        per caller, counted before a streamed request's tensors are read (`payloads` is then its Header)."""
        await self._check_uid(request, context)
        if self.server.inflight >= self.limits.max_concurrent_requests:
            await refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server busy: {self.server.inflight} requests in flight (limit {self.limits.max_concurrent_requests})",
            )
        # what this request's tensors take once decoded (float32), as its header claims them
        held = 4 * sum(max(0, math.prod(t.shape)) for _, t in framing.tensor_paths(request))
        caller = self._caller(context)
        await self._admit_bytes(held, caller, context)
        self.server.inflight_bytes += held
        self._held_by[caller] = self._held_by.get(caller, 0) + held
        self.server.inflight += 1
        self.server.stir()  # a resting server looks at its replicas' progress at the fast period again
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        started, outcome = time.perf_counter(), "error"
        try:
            if isinstance(payloads, framing.Header):
                payloads = await self._read_payloads(payloads, remaining)
            result = await handler(request, payloads, deadline)
            outcome = "ok"
            self._count_bytes(request, payloads, result)
            return result
        except Refused as e:
            await refuse(context, e.code, e.message, e.reason)
        except InputError as e:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Late as e:
            await refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except RankDied as e:
            await refuse(context, grpc.StatusCode.UNAVAILABLE, f"this server is stopping: {e}")
        except ExpertsUnavailable as e:
            await refuse(context, grpc.StatusCode.UNAVAILABLE, f"experts unavailable: {e}", Reason.EXPERTS_UNAVAILABLE)
        except TimeoutError:
            await refuse(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "experts unavailable: the expert calls ran out of time",
                Reason.EXPERTS_UNAVAILABLE,
            )
        except BadGradient as e:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            self.server.inflight -= 1
            self.server.inflight_bytes -= held
            left = self._held_by.get(caller, held) - held
            if left > 0:
                self._held_by[caller] = left
            else:
                self._held_by.pop(caller, None)  # entries only for callers with requests running: bounded
            metrics = getattr(self.server, "metrics", None)
            if metrics is not None:
                metrics.request(handler.__name__.strip("_"), outcome == "ok", time.perf_counter() - started)

    def _count_bytes(self, request, payloads: dict, result) -> None:
        metrics = getattr(self.server, "metrics", None)
        if metrics is None:
            return
        response, sent = result
        received = request.ByteSize() + sum(len(p) for p in payloads.values())
        metrics.bytes.labels("received", "activations").inc(received)
        metrics.bytes.labels("sent", "activations").inc(response.ByteSize() + sum(len(p) for p in sent.values()))

    async def _read_header(self, request_iterator, message_type, context) -> framing.Header:
        try:
            return await asyncio.wait_for(
                framing.read_header(
                    request_iterator, message_type, self.limits.max_message_bytes, self.limits.max_tensor_elements
                ),
                self.limits.read_timeout,
            )
        except TimeoutError:
            await refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED, "no stream header within server.read_timeout")
        except framing.StreamTooLarge as e:
            await refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), Reason.BAD_INPUT)  # too large to take
        except (framing.FramingError, codec.TensorDecodeError) as e:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _read_payloads(self, header: framing.Header, remaining: float | None) -> dict:
        """A streamed request's tensors, within server.read_timeout (or the caller's deadline, if sooner)."""
        bound = self.limits.read_timeout if remaining is None else min(remaining, self.limits.read_timeout)
        try:
            return await asyncio.wait_for(framing.read_payloads(header), bound)
        except TimeoutError:
            raise Late(
                f"the stream's tensors ({header.claimed} bytes claimed) did not arrive within {bound:.1f} s"
            ) from None
        except framing.FramingError as e:
            raise InputError(str(e)) from None

    def _caller(self, context) -> str:
        """Who counts for the per-caller limits: the admitted peer id, else (admission off) the host."""
        peer = CALLER.get()
        return peer or context.peer().rsplit(":", 1)[0]

    async def _admit_bytes(self, held: int, caller: str, context) -> None:
        busy, mine = self.server.inflight_bytes, self._held_by.get(caller, 0)
        if busy + held > self.limits.max_inflight_bytes:
            await refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server busy: {busy + held} bytes of request tensors would be held "
                f"(limit server.max_inflight_bytes = {self.limits.max_inflight_bytes})",
            )
        if mine + held > self.limits.max_inflight_bytes_per_peer:
            await refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{mine + held} bytes of request tensors of this caller would be held "
                f"(limit server.max_inflight_bytes_per_peer = {self.limits.max_inflight_bytes_per_peer})",
            )

    def _frames(self, response, payloads):
        return framing.frames(response, payloads, self.limits.chunk_bytes)

    # ---- info and state -------------------------------------------------------------------
    async def Info(self, request, context):
        try:
            replica = self._described(request.expert)
        except Refused as e:
            await refuse(context, e.code, e.message, e.reason)
        rt = replica.runtime
        history = [
            stage_pb2.StepFingerprint(
                epoch=f.epoch,
                samples=f.samples,
                values=f.values,
                members=f.members,
                coverage=[
                    stage_pb2.Coverage(peer_id=pid, incarnation=inc, seq=seq) for pid, (inc, seq) in f.coverage.items()
                ],
            )
            for f in list(rt.history)
        ]
        return stage_pb2.InfoResponse(
            run_id=replica.run_id,
            stage=replica.stage,
            peer_id=replica.dht.peer_id,
            epoch=rt.epoch,
            samples_accumulated=rt.samples_accumulated,
            samples_stepped=rt.samples_stepped,
            throughput=rt.throughput,
            load=self.server.inflight,
            history=history,
            incarnation=rt.incarnation,
            stepped_seq=rt.stepped_seq,
            state=replica.record().state,
            samples_averaging=replica.samples_averaging,
        )

    async def Round(self, request: stage_pb2.RoundRequest, context):
        try:
            replica = self._replica(request.run_id, request.stage, request.expert)
        except Refused as e:
            await refuse(context, e.code, e.message, e.reason)
        # an inviter is who the call comes from: with admission on, only the admitted caller may name itself
        inviter = request.inviter if CALLER.get() in (None, "", request.inviter) else ""
        joining = replica.join_round(request.epoch, inviter)
        replica.stir()
        return stage_pb2.RoundResponse(joining=joining, epoch=replica.runtime.epoch)

    async def Progress(self, request: stage_pb2.ProgressRequest, context):
        """A partner replica pushes its record (peer.server.replica_push); ours goes back."""
        try:
            replica = self._replica(request.run_id, request.stage, request.expert)
            own = replica.take_pushed(request.record, CALLER.get())
        except Refused as e:
            await refuse(context, e.code, e.message, e.reason)
        return stage_pb2.ProgressResponse(record=own)

    async def Average(self, frames, context):
        """A partner replica's all-reduce call (peer.server.allreduce), for the part its header names."""
        try:
            header = await first_header(frames, self.server.spec.averaging.group_timeout)
        except ValueError as e:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), Reason.BAD_INPUT)
        try:
            replica = self._replica(header.run_id, header.stage, header.expert)
        except Refused as e:
            await refuse(context, e.code, e.message, e.reason)
        if replica.averager is None:
            await refuse(
                context, grpc.StatusCode.FAILED_PRECONDITION, "this replica does not average", Reason.WRONG_PART
            )
        if len(header.group) > self.server.spec.averaging.max_group_size:
            await refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"group: {len(header.group)} members, more than averaging.max_group_size",
                Reason.BAD_INPUT,
            )
        try:
            async for frame in replica.averager.allreduce.serve(header, frames, CALLER.get()):
                yield frame
        except Refused as e:  # a stranger, another run or part, another step: refused before any piece is read
            await refuse(context, e.code, e.message, e.reason)

    async def GetState(self, request_bytes: bytes, context):
        try:
            request = stage_pb2.StateRequest.FromString(request_bytes)
        except DecodeError as e:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"not a StateRequest: {e}")
        try:
            replica = self._state_of(request.run_id, request.stage, request.expert)
        except Refused as e:
            await refuse(context, e.code, e.message, e.reason)
        if self.server.inflight >= self.limits.max_concurrent_requests:
            await refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "server busy: too many requests in flight")
        wrong = shard_request_error(request.shard, request.num_shards, self.limits.max_state_shards)
        if wrong:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, wrong, Reason.BAD_INPUT)
        num_shards = max(request.num_shards, 1)
        self.server.inflight += 1
        try:
            try:
                epoch = request.epoch if request.HasField("epoch") else None
                metadata, tensors = await replica.run_torch(replica.runtime.snapshot, request.shard, num_shards, epoch)
            except RankDied as e:
                await refuse(context, grpc.StatusCode.UNAVAILABLE, f"this server is stopping: {e}")
        finally:
            self.server.inflight -= 1
        if request.HasField("epoch") and metadata["epoch"] != request.epoch:
            await refuse(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this replica is at step {metadata['epoch']}, not at the requested step {request.epoch}",
                Reason.STALE_EPOCH,
            )
        replica.fed(CALLER.get(), int(metadata["epoch"]))  # a joiner that holds this step now (a leaver's handover)
        response, payloads = stage_pb2.StateResponse(metadata_json=json.dumps(metadata, sort_keys=True)), {}
        for i, (name, tensor) in enumerate(tensors.items()):
            header, payloads[f"tensors.{i}.tensor"] = codec.encode_payload(tensor)
            response.tensors.add(name=name, tensor=header)
        for frame in self._frames(response, payloads):
            yield frame


class StageServicer(ServicerBase, stage_pb2_grpc.StageServicer):
    SERVICE = "swarmtrain.Stage"
    FORWARD = (stage_pb2.ForwardRequest, stage_pb2.ForwardResponse)
    BACKWARD = (stage_pb2.BackwardRequest, stage_pb2.BackwardResponse)

    def __init__(self, server: Replica):
        """`server` is the process's StageServer (peer.server.stage), which imports this module."""
        super().__init__(server, server.cfg.server)
        self.runtime = server.runtime
        self.held: set[str] = set()  # uids whose answer the backward.unanswered failpoint held (a few, in tests)

    def _replica(self, run_id: str, stage: int, expert: str) -> Replica:
        self._check_route(run_id, stage)
        if expert:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "this is a stage server; it holds no experts")
        return self.server

    def _described(self, expert: str) -> Replica:
        if expert:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "this is a stage server; it holds no experts")
        return self.server

    def _check_route(self, run_id: str, stage: int, leaving: bool = False) -> None:
        self._check_run(run_id, leaving)
        if stage != self.server.stage:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION, f"this server serves stage {self.server.stage}, not stage {stage}"
            )

    # ---- forward / backward ---------------------------------------------------------------
    def _routed_inputs(self, request, payloads: dict, leaving: bool = False):
        """Check a forward/backward request is for this run and stage (and this server not `leaving`, unless
        allowed); its decoded inputs."""
        self._check_route(request.run_id, request.stage, leaving)
        inputs = self._decode(request.inputs, "inputs", request.HasField("inputs"), payloads)
        if inputs is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "inputs: missing")
        return inputs

    async def _forward(self, request: stage_pb2.ForwardRequest, payloads: dict, deadline: float | None):
        inputs = self._routed_inputs(request, payloads)
        targets = self._decode(request.targets, "targets", request.HasField("targets"), payloads)

        def job():
            if deadline is not None and time.monotonic() > deadline:
                raise Late("the request's deadline passed while it waited")  # the caller went elsewhere
            # the step read beside the forward (same thread): the weights the answer comes from
            return self.runtime.forward(request.uid, inputs, targets, request.train), self.runtime.progress

        if request.train:
            await self.server.forward_gate(deadline)  # while the stage drains for a step (peer.server.replica_round)
        if request.step:
            await self.server.step_gate(request.step, deadline)  # synchronous mode: after the steps before it
        result, epoch = await self.server.run_torch(job)
        if targets is not None:
            return stage_pb2.ForwardResponse(has_loss=True, loss=float(result), epoch=epoch), {}
        header, payload = codec.encode_payload(result, request.output_codec, self.block_size)
        return stage_pb2.ForwardResponse(outputs=header, epoch=epoch), {"outputs": payload}

    async def _backward(self, request: stage_pb2.BackwardRequest, payloads: dict, deadline: float | None):
        # leaving, it still answers a backward it added (a retry of one whose answer never came), adding nothing:
        # its caller learns the addition's number and settles it by this server's steps, instead of counting it
        # elsewhere as well (a round under way while it leaves may step it); any other is refused as leaving
        added = bool(request.uid) and not request.dry and request.uid in self.runtime.counted
        inputs = self._routed_inputs(request, payloads, leaving=added)
        grad_outputs = self._decode(request.grad_outputs, "grad_outputs", request.HasField("grad_outputs"), payloads)
        targets = self._decode(request.targets, "targets", request.HasField("targets"), payloads)
        if request.step:
            await self.server.step_gate(request.step, deadline)  # synchronous mode (the last stage's forward is here)
        grad_inputs, loss, epoch, seq, incarnation, stepped_seq = await self.server.backward(
            request.uid, inputs, grad_outputs, targets, deadline, count=not request.dry
        )
        if (
            seq
            and deadline is not None
            and request.uid not in self.held
            and self.server.failpoints.fails("backward.unanswered")
        ):
            self.held.add(request.uid)  # counted; the answer comes too late (the same uid asked again: in time)
            await asyncio.sleep(max(deadline - time.monotonic(), 0.0) + 0.5)
        response = stage_pb2.BackwardResponse(epoch=epoch, seq=seq, incarnation=incarnation, stepped_seq=stepped_seq)
        out = {}
        if grad_inputs is not None:
            header, out["grad_inputs"] = codec.encode_payload(grad_inputs, request.output_codec, self.block_size)
            response.grad_inputs.CopyFrom(header)
        if loss is not None:
            response.has_loss, response.loss = True, loss
        return response, out


def parsed(handler, message_type):
    """`handler` taking raw bytes: a request that does not parse gets INVALID_ARGUMENT naming the type
    (gRPC's own deserializer would answer INTERNAL)."""

    async def handle(raw: bytes, context):
        try:
            request = message_type.FromString(raw)
        except DecodeError as e:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"not a {message_type.__name__}: {e}")
        return await handler(request, context)

    return handle


def add_to_server(servicer: ServicerBase, server: grpc.aio.Server) -> None:
    """Register a servicer's service: unary methods with protobuf messages, streams as raw framed bytes."""
    forward_types, backward_types = servicer.FORWARD, servicer.BACKWARD
    unary = {
        "Forward": (servicer.Forward, *forward_types),
        "Backward": (servicer.Backward, *backward_types),
        "Info": (servicer.Info, stage_pb2.InfoRequest, stage_pb2.InfoResponse),
        "Round": (servicer.Round, stage_pb2.RoundRequest, stage_pb2.RoundResponse),
        "Progress": (servicer.Progress, stage_pb2.ProgressRequest, stage_pb2.ProgressResponse),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(parsed(fn, req), response_serializer=resp.SerializeToString)
        for name, (fn, req, resp) in unary.items()
    }
    handlers["ForwardStream"] = grpc.stream_stream_rpc_method_handler(servicer.ForwardStream)
    handlers["BackwardStream"] = grpc.stream_stream_rpc_method_handler(servicer.BackwardStream)
    handlers["GetState"] = grpc.unary_stream_rpc_method_handler(servicer.GetState)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(servicer.SERVICE, handlers),))
    average = grpc.stream_stream_rpc_method_handler(servicer.Average)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(AVERAGING_SERVICE, {"Average": average}),))

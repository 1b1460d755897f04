"""Bad requests get a clear gRPC status and the server keeps serving (real server process, real gRPC)."""

from __future__ import annotations

import grpc
import pytest
import torch
from helpers.calls import channel, info

from protocols import codec, stage_pb2, stage_pb2_grpc, tensor_pb2
from protocols.failures import Reason, reason_of

SPEC = {
    "name": "badinput",
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "max_seq_len": 16},
    "stages": {"num_stages": 2},
    "training": {"micro_batch_size": 2, "seq_len": 16, "target_batch_size": 4, "total_steps": 5},
}


@pytest.fixture
def stage1(swarm):
    swarm.coordinator(SPEC)
    server = swarm.server(
        "s1", 1, ["--set", "server.max_tensor_elements=4096", "--set", "server.max_message_bytes=100000"]
    )
    endpoint = swarm.endpoint(server)
    with channel(endpoint) as ch:
        yield stage_pb2_grpc.StageStub(ch), endpoint


def _forward(stub, inputs: tensor_pb2.Tensor, **fields):
    request = stage_pb2.ForwardRequest(run_id="badinput", stage=1, inputs=inputs, **fields)
    return stub.Forward(request, timeout=10)


def _status(call, ours: bool = True) -> tuple[grpc.StatusCode, str]:
    """The refusal's code and message; its machine-readable reason (protocols.failures) is checked too:
    each refusal of the server's handlers here is the caller's fault (BAD_INPUT) but for the wrong stage
    (WRONG_PART). One that gRPC itself makes (not `ours`) carries none."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    wanted = Reason.WRONG_PART if e.value.code() == grpc.StatusCode.FAILED_PRECONDITION else Reason.BAD_INPUT
    wanted = wanted if ours else None
    assert reason_of(e.value) == wanted, (e.value.code(), e.value.details(), e.value.trailing_metadata())
    return e.value.code(), e.value.details()


def test_bad_requests_are_refused_and_server_keeps_serving(stage1):
    stub, endpoint = stage1
    good = torch.randn(2, 8, 32)

    code, message = _status(lambda: _forward(stub, codec.encode(torch.randn(2, 8, 31))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "hidden states of shape [batch, seq, 32]" in message

    code, message = _status(lambda: _forward(stub, codec.encode(good.double().float().to(torch.float16))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "float32" in message

    code, message = _status(lambda: _forward(stub, codec.encode(torch.randn(20, 16, 32))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "over the limit of 4096" in message

    broken = codec.encode(good)
    broken.data = broken.data[:-4]
    code, message = _status(lambda: _forward(stub, broken))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in message

    nan = good.clone()
    nan[0, 0, 0] = float("nan")
    code, message = _status(lambda: _forward(stub, codec.encode(nan)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in message

    code, message = _status(
        lambda: stub.Forward(
            stage_pb2.ForwardRequest(run_id="badinput", stage=0, inputs=codec.encode(good)), timeout=10
        )
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "stage 1" in message

    targets = torch.randint(0, 256, (2, 8))
    code, message = _status(
        lambda: stub.Backward(
            stage_pb2.BackwardRequest(
                run_id="badinput", stage=1, inputs=codec.encode(good), targets=codec.encode(targets[:, :4])
            ),
            timeout=10,
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "targets" in message

    # streamed: a header announcing too large a tensor is refused before anything is allocated
    huge = tensor_pb2.Tensor(shape=[1000, 16, 32], dtype=tensor_pb2.FLOAT32)
    header = stage_pb2.ForwardRequest(run_id="badinput", stage=1, inputs=huge).SerializeToString()
    code, message = _status(lambda: list(stub.ForwardStream(iter([stage_pb2_pb_chunk(header)]), timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "over the limit of 4096" in message
    # streamed: a message over max_message_bytes
    oversized = stage_pb2.ForwardRequest(run_id="badinput", stage=1, uid="x" * 150_000).SerializeToString()
    streamed = lambda: list(stub.ForwardStream(iter([stage_pb2_pb_chunk(oversized)]), timeout=10))  # noqa: E731
    code, message = _status(streamed, ours=False)  # gRPC's own limit on one message
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED

    # a message above the chunk size travels as a framed stream and gives the same answer
    import asyncio

    from helpers.calls import client as admitted_client

    async def both():
        client = admitted_client(endpoint, chunk_bytes=1024, max_message_bytes=10**6)
        try:
            request = stage_pb2.ForwardRequest(run_id="badinput", stage=1, inputs=codec.encode(good))
            streamed, payloads = await client.forward(endpoint, request, timeout=10)
            unary = _forward(stub, codec.encode(good))
            return codec.decode(streamed.outputs, payload=payloads["outputs"]), codec.decode(unary.outputs)
        finally:
            await client.close()

    streamed, unary = asyncio.run(both())
    assert torch.equal(streamed, unary) and streamed.shape == (2, 8, 256)  # the last stage returns logits

    # still serving: a correct request works and nothing was accumulated from the refused ones
    response = _forward(stub, codec.encode(good), targets=codec.encode(targets))
    assert response.has_loss and 4.0 < response.loss < 7.0
    state = info(endpoint)
    assert state.samples_accumulated == 0 and state.epoch == 0


def stage_pb2_pb_chunk(data: bytes) -> tensor_pb2.Chunk:
    return tensor_pb2.Chunk(data=data)


def test_bad_averaging_calls_are_refused_with_a_reason_and_server_keeps_serving(stage1):
    """The replicas' all-reduce service (peer.server.allreduce) on a live stage server: a call that does not start
    with a header, one from a caller that names another sender, one for another stage: each a gRPC status with
    its reason before any piece is read; the server serves on."""
    from protocols import averaging_pb2

    stub, endpoint = stage1
    with channel(endpoint) as ch:
        average = ch.stream_stream("/swarmtrain.Averaging/Average")

        def call(*frames: bytes):
            return list(average(iter(frames), timeout=10))

        def header(**fields) -> bytes:
            sender = averaging_pb2.Contribution(peer_id="someone-else", samples=3)
            fields = {"run_id": "badinput", "stage": 1, "epoch": 0, "group": ["a", "someone-else"], **fields}
            return averaging_pb2.AverageFrame(
                header=averaging_pb2.AverageHeader(sender=sender, **fields)
            ).SerializeToString()

        code, message = _status(lambda: call(b"\x12\x03abc"))  # a piece where the header must be
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "must start with its header" in message
        with pytest.raises(grpc.RpcError) as e:
            call(header())
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and reason_of(e.value) == Reason.NOT_ADMITTED
        assert "not from someone-else" in e.value.details()
        code, message = _status(lambda: call(header(stage=0)))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "stage 1, not stage 0" in message
    assert info(endpoint).stage == 1

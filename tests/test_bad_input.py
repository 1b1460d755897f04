"""Bad requests get a clear gRPC status and the server keeps serving (real server process, real gRPC)."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from helpers.calls import channel, info, test_credential

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

    # a uid of 4,000 characters (uids are kept in the dedup and forward caches)
    code, message = _status(
        lambda: stub.Forward(
            stage_pb2.ForwardRequest(run_id="badinput", stage=1, uid="u" * 4000, inputs=codec.encode(good)), timeout=10
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "server.max_uid_length" in message, message

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


def _key_id(stage: int) -> bytes:
    from hivemind.dht.routing import DHTID

    from dht import keys

    return DHTID.generate(source=keys.servers_key("badinput", stage)).to_bytes()


def _subkey(owner: str) -> bytes:
    import msgpack

    from dht import keys

    return msgpack.packb(keys.signed_subkey(owner), use_bin_type=True)


def _signed(credential, stage: int, **fields) -> stage_pb2.SignedRecord:
    """A ServerRecord of the test process (its own identity and credential), sealed for `stage`'s key as a replica
    seals the record it pushes (peer.server.replica_push)."""
    from dht import envelope
    from dht.records import ServerRecord

    owner = credential.identity.peer_id
    record = ServerRecord(stage=stage, endpoint="127.0.0.1:9", throughput=1.0, updated=time.time(), **fields)
    expiration = time.time() + 10
    payload = record.model_dump_json().encode()
    sealed = envelope.seal(
        credential.identity, _key_id(stage), _subkey(owner), expiration, payload, credential.certificate
    )
    return stage_pb2.SignedRecord(owner=owner, expiration=expiration, envelope=sealed)


def test_bad_progress_pushes_are_refused_and_a_believable_one_taken_no_further_than_a_dht_record(stage1, swarm):
    """A replica's Progress push (peer.server.replica_push) on a live stage server: a record that is not the
    caller's own, too large, not signed for this stage, or for another stage is refused with its reason; a
    record that counts is answered with the server's own signed record, and its claimed step (far ahead of the
    stage's two honest replicas) is believed no more than the same claim in the DHT: the server says so and
    serves on at its own step."""
    from dht import envelope
    from dht.records import ServerRecord

    _, endpoint = stage1
    second = swarm.server("s1b", 1)  # a second honest replica: the claim is then one against two
    swarm.endpoint(second)
    credential = test_credential(endpoint)
    with channel(endpoint, credential) as ch:
        push = ch.unary_unary(
            "/swarmtrain.Stage/Progress",
            request_serializer=stage_pb2.ProgressRequest.SerializeToString,
            response_deserializer=stage_pb2.ProgressResponse.FromString,
        )

        def call(record: stage_pb2.SignedRecord, stage: int = 1):
            return push(stage_pb2.ProgressRequest(run_id="badinput", stage=stage, record=record), timeout=10)

        good = _signed(credential, 1)
        with pytest.raises(grpc.RpcError) as e:
            call(stage_pb2.SignedRecord(owner="someone-else", envelope=good.envelope))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and reason_of(e.value) == Reason.NOT_ADMITTED
        assert "its own record only" in e.value.details()
        big = stage_pb2.SignedRecord(owner=good.owner, expiration=good.expiration, envelope=b"x" * 70000)
        code, message = _status(lambda: call(big))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "network.max_pushed_record_bytes" in message
        garbage = stage_pb2.SignedRecord(owner=good.owner, expiration=good.expiration, envelope=b"not an envelope")
        code, message = _status(lambda: call(garbage))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid record of stage 1" in message
        code, message = _status(lambda: call(_signed(credential, 0)))  # signed for stage 0's key
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid record of stage 1" in message
        code, message = _status(lambda: call(good, stage=0))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "stage 1, not stage 0" in message

        answer = call(_signed(credential, 1, epoch=10**9, step=10**9)).record
    payload = envelope.open_envelope(
        answer.owner, _key_id(1), _subkey(answer.owner), answer.expiration, answer.envelope
    )
    assert payload is not None, "the server's answer is not its own record, signed for stage 1"
    assert ServerRecord.model_validate_json(payload).epoch == 0
    server = next(p for p in swarm.peers if p.name == "s1")
    server.wait_for(r"claims step 1000000000, which most replicas do not back", 30)
    described = info(endpoint)
    assert described.stage == 1 and described.epoch == 0 and described.state == "serving"

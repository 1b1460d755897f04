"""Tensor codec and stream framing (unit tests; the wire itself is covered by the tests with real servers)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from protocols import codec, tensor_pb2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8])
def test_roundtrip_is_exact_without_compression(dtype):
    t = (torch.randn(3, 5) * 50).to(dtype)
    out = codec.decode(codec.encode(t))
    assert out.dtype == dtype and torch.equal(out, t)


@pytest.mark.parametrize(("name", "tolerance", "size"), [("fp16", 1e-3, 2), ("bf16", 1e-2, 2)])
def test_compression_halves_bytes_within_tolerance(name, tolerance, size):
    t = torch.randn(64, 64)
    message = codec.encode(t, codec.codec_from_name(name))
    assert codec.wire_bytes(message) == t.numel() * size
    assert torch.allclose(codec.decode(message), t, rtol=tolerance, atol=tolerance)


def test_integer_tensors_are_never_compressed():
    ids = torch.arange(300)
    message = codec.encode(ids, tensor_pb2.FP16)
    assert message.codec == tensor_pb2.NONE and torch.equal(codec.decode(message), ids)


def test_bad_messages_name_the_problem():
    with pytest.raises(codec.TensorDecodeError, match="over the limit"):
        codec.decode(codec.encode(torch.zeros(10, 10)), max_elements=99)
    bad = codec.encode(torch.zeros(4))
    bad.data = bad.data[:3]
    with pytest.raises(codec.TensorDecodeError, match="needs 16"):
        codec.decode(bad)
    with pytest.raises(codec.TensorDecodeError, match="unknown tensor dtype"):
        codec.decode(tensor_pb2.Tensor(shape=[1], dtype=0, data=b"\x00"))
    with pytest.raises(ValueError, match="unknown compression"):
        codec.codec_from_name("int3")


def test_framed_stream_roundtrip_keeps_tensors_out_of_protobuf():
    from protocols import framing, stage_pb2

    big, small = torch.randn(300, 70), torch.randint(0, 256, (3, 5))
    header, payload = codec.encode_payload(big)
    request = stage_pb2.BackwardRequest(run_id="r", stage=1, grad_outputs=header, targets=codec.encode(small))
    request.targets.data = b""
    payloads = {"grad_outputs": payload, "targets": codec.encode_payload(small)[1]}
    frames = list(framing.frames(request, payloads, chunk_bytes=4096))
    assert len(frames) > big.numel() * 4 // 4096 and all(len(f) <= 4096 + 8 for f in frames[1:])

    async def read(limit, parts=frames):
        async def gen():
            for f in parts:
                yield f

        return await framing.read(gen(), stage_pb2.BackwardRequest, limit)

    message, received = asyncio.run(read(10**7))
    assert message.run_id == "r" and set(received) == {"grad_outputs", "targets"}
    assert torch.equal(codec.decode(message.grad_outputs, payload=received["grad_outputs"]), big)
    assert torch.equal(codec.decode(message.targets, payload=received["targets"]), small)
    with pytest.raises(framing.StreamTooLarge):
        asyncio.run(read(1000))
    with pytest.raises(framing.FramingError, match="ended inside tensor"):
        asyncio.run(read(10**7, frames[:-1]))

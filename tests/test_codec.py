"""Tensor codec and stream framing (unit tests; the wire itself is covered by the tests with real servers)."""

from __future__ import annotations

import asyncio
import math

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


@pytest.mark.parametrize("block_size", [1, 7, 64, 128, 4096])
@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 33, 64), (1000,)])
def test_int8_roundtrip_error_is_within_half_a_step_of_each_block(block_size, shape):
    t = torch.randn(*shape) * torch.logspace(-3, 3, math.prod(shape)).view(shape)  # blocks of very different scales
    message = codec.encode(t, tensor_pb2.INT8, block_size)
    out = codec.decode(message)
    assert out.dtype == torch.float32 and out.shape == t.shape
    flat, err = t.reshape(-1), (out - t).abs().reshape(-1)
    for start in range(0, flat.numel(), block_size):
        block = slice(start, start + block_size)
        # half of one quantization step (absmax/127/2), plus float32 rounding of values up to absmax
        bound = flat[block].abs().max() * (1 / 254 + 2**-20)
        assert err[block].max() <= bound, (start, err[block].max(), bound)
    blocks = -(-t.numel() // block_size)
    assert codec.wire_bytes(message) == t.numel() + 4 * blocks


def test_int8_cuts_activation_bytes_to_about_a_quarter():
    hidden = torch.randn(16, 128, 192)  # a micro-batch of hidden states
    ratio = codec.wire_bytes(codec.encode(hidden, tensor_pb2.INT8)) / codec.wire_bytes(codec.encode(hidden))
    assert ratio <= 0.26
    relative = (codec.decode(codec.encode(hidden, tensor_pb2.INT8)) - hidden).norm() / hidden.norm()
    assert relative < 0.01


def test_int8_keeps_zeros_and_marks_non_finite_blocks():
    t = torch.zeros(300)
    t[200] = float("inf")
    out = codec.decode(codec.encode(t, tensor_pb2.INT8, 128))
    assert torch.equal(out[:128], torch.zeros(128))  # an all-zero block stays exactly zero
    assert torch.isnan(out[128:256]).all()  # the receiver sees the block as non-finite and refuses it
    assert torch.equal(out[256:], torch.zeros(44))


def test_int8_bad_headers_name_the_problem():
    message = codec.encode(torch.randn(10), tensor_pb2.INT8, 4)
    message.block_size = 0
    with pytest.raises(codec.TensorDecodeError, match="block_size 0"):
        codec.decode(message)
    message.block_size = 4
    message.data = message.data[:-1]
    with pytest.raises(codec.TensorDecodeError, match="needs 22"):
        codec.decode(message)
    ids = codec.encode(torch.arange(5), tensor_pb2.INT8)
    assert ids.codec == tensor_pb2.NONE  # integers travel raw


@pytest.mark.parametrize(
    ("name", "tolerance"), [("bf16", 1e-2), ("int8", 1.0 / 254), ("fp16", 1e-3), ("int4", 1.0 / 14), ("none", 0.0)]
)
def test_averaging_pieces_roundtrip(name, tolerance):
    from peer.server.piece_codec import PieceCodec

    chosen = PieceCodec(name, block_size=64)
    t = torch.randn(3000)
    data = chosen.encode(t)
    assert len(data) == chosen.size(t.numel())
    expected = {"none": 4, "fp16": 2, "bf16": 2, "int8": 1 + 4 / 64, "int4": 0.5 + 4 / 64}[name]
    assert len(data) <= t.numel() * expected + 8
    out = chosen.decode(data, t.numel())
    assert out.shape == t.shape and out.dtype == torch.float32
    assert (out - t).abs().max() <= tolerance * t.abs().max() * 1.01


def test_averaging_pieces_from_a_peer_are_checked_before_anything_is_allocated():
    """A hostile member's piece: its size must be what the owner's own element count makes of it, whatever it
    holds (the owner allocates by its own count, never by what the piece says)."""
    from peer.server.piece_codec import PieceCodec, PieceError

    for name in ("none", "fp16", "int8", "int4"):
        chosen = PieceCodec(name, block_size=64)
        good = bytes(chosen.encode(torch.randn(100)))
        with pytest.raises(PieceError, match="not"):
            chosen.decode(good + b"\0", 100)
        with pytest.raises(PieceError, match="not"):
            chosen.decode(good, 2**30)
        assert chosen.decode(good, 100).shape == (100,)


@pytest.mark.parametrize("numel", [0, 1, 7, 64, 65, 1001])
def test_int4_rounds_each_element_within_half_a_step_of_its_block(numel):
    """Codes -7..7 of each block's absmax / 7, two a byte: an odd count pads the last byte, a block of zeros stays 0,
    and a block with a NaN decodes to NaN (refused downstream as the raw tensor would be)."""
    from peer.server.piece_codec import PieceCodec

    chosen = PieceCodec("int4", block_size=16)
    t = torch.randn(numel) * torch.logspace(-3, 3, numel) if numel else torch.empty(0)
    data = chosen.encode(t)
    blocks = -(-numel // 16)
    assert len(data) == 4 * blocks + (numel + 1) // 2  # scales, nibbles
    out = chosen.decode(data, numel)
    assert out.shape == t.shape
    for start in range(0, numel, 16):
        block, got = t[start : start + 16], out[start : start + 16]
        assert (got - block).abs().max() <= block.abs().max() / 14 * 1.0001
    zeros = torch.zeros(40)
    zeros[35] = math.nan
    back = chosen.roundtrip(zeros)
    assert torch.equal(back[:32], torch.zeros(32)) and back[32:].isnan().all()


def test_a_tensor_rounded_by_an_averaging_codec_crosses_the_pieces_unchanged():
    """The all-reduce cuts the flat vector into pieces of whole blocks and encodes each on its own: a vector local
    mode already rounded (error feedback) is not rounded again on its way to the owner."""
    from peer.server.piece_codec import PieceCodec
    from peer.server.slicing import piece_bounds, slice_bounds

    for name in ("int4", "int8"):
        chosen = PieceCodec(name, block_size=128)
        rounded = chosen.roundtrip(torch.randn(2_500_000) * torch.linspace(0.01, 10, 2_500_000))
        pieces = [p for lo, hi in slice_bounds(rounded.numel(), 3, 128) for p in piece_bounds(lo, hi, 128 * 1000)]
        assert len(pieces) > 3 and all(lo % 128 == 0 for lo, _ in pieces)
        assert torch.equal(torch.cat([chosen.roundtrip(rounded[lo:hi]) for lo, hi in pieces]), rounded)

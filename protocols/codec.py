"""Tensor <-> protobuf conversion, with optional lossy compression of float tensors."""

from __future__ import annotations

import math
import warnings

import torch

from protocols import tensor_pb2

_TO_WIRE_DTYPE = {
    torch.float32: tensor_pb2.FLOAT32,
    torch.float16: tensor_pb2.FLOAT16,
    torch.bfloat16: tensor_pb2.BFLOAT16,
    torch.int64: tensor_pb2.INT64,
    torch.int32: tensor_pb2.INT32,
    torch.uint8: tensor_pb2.UINT8,
}
_FROM_WIRE_DTYPE = {v: k for k, v in _TO_WIRE_DTYPE.items()}
_ELEMENT_SIZE = {
    tensor_pb2.FLOAT32: 4,
    tensor_pb2.FLOAT16: 2,
    tensor_pb2.BFLOAT16: 2,
    tensor_pb2.INT64: 8,
    tensor_pb2.INT32: 4,
    tensor_pb2.UINT8: 1,
}
_CODEC_BY_NAME = {"none": tensor_pb2.NONE, "fp16": tensor_pb2.FP16, "bf16": tensor_pb2.BF16, "int8": tensor_pb2.INT8}
_CODEC_ELEMENT_SIZE = {tensor_pb2.FP16: 2, tensor_pb2.BF16: 2, tensor_pb2.INT8: 1}
CODEC_NAMES = tuple(_CODEC_BY_NAME)  # what a run spec may name
DEFAULT_BLOCK_SIZE = 128  # elements per int8 scale: 4 bytes per 128 keep int8 at 0.258 of fp32
MAX_BLOCK_SIZE = 1 << 20


class TensorDecodeError(ValueError):
    """A Tensor message that cannot be turned into a torch tensor; the message names the problem."""


def codec_from_name(name: str) -> int:
    """The wire codec for a run spec's compression name ('none', 'fp16', 'bf16', 'int8')."""
    try:
        return _CODEC_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown compression {name!r}; expected one of {sorted(_CODEC_BY_NAME)}") from None


def blockwise_codes(tensor: torch.Tensor, block_size: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax rounding: (float32 scale per block, float codes in -levels..levels, flat, one per element).

    Each block of `block_size` consecutive elements (row-major; the last block may be short) is
    scaled by its largest magnitude / `levels` and rounded, so an element's error is at most half its
    block's scale. A block with a NaN or infinity gets a NaN scale: it decodes to NaN, and the
    receiver refuses it as it would the raw tensor.
    """
    flat = tensor.detach().reshape(-1).float()
    n = flat.numel()
    blocks = -(-n // block_size)
    padded = torch.nn.functional.pad(flat, (0, blocks * block_size - n)).view(blocks, block_size)
    absmax = padded.abs().amax(dim=1, keepdim=True)
    absmax = torch.where(torch.isfinite(absmax), absmax, torch.full_like(absmax, math.nan))
    scale = absmax / float(levels)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.nan_to_num(padded / safe, nan=0.0).round_().clamp_(-levels, levels)
    return scale.view(-1), codes.view(-1)[:n]


def blockwise_values(scales: torch.Tensor, codes: torch.Tensor, block_size: int) -> torch.Tensor:
    """The float32 elements (flat) of blockwise codes (any numeric dtype) and their scales."""
    n = codes.numel()
    blocks = scales.numel()
    padded = torch.nn.functional.pad(codes.to(torch.float32), (0, blocks * block_size - n)).view(blocks, block_size)
    return padded.mul_(scales.view(-1, 1)).view(-1)[:n]


def quantize_int8(tensor: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax int8 (blockwise_codes at 127 levels): (float32 scale per block, int8 per element), on the
    tensor's device."""
    scales, codes = blockwise_codes(tensor, block_size, 127)
    return scales, codes.to(torch.int8)


def dequantize_int8(scales: torch.Tensor, q: torch.Tensor, block_size: int) -> torch.Tensor:
    """The float32 elements (flat) that quantize_int8 encoded as `scales` and `q`."""
    return blockwise_values(scales, q, block_size)


def _payload_array(tensor: torch.Tensor, codec: int, block_size: int = DEFAULT_BLOCK_SIZE):
    tensor = tensor.detach()
    if tensor.dtype not in _TO_WIRE_DTYPE:
        raise TypeError(f"cannot send a tensor of dtype {tensor.dtype}")
    if not tensor.is_floating_point():
        codec = tensor_pb2.NONE
    if codec == tensor_pb2.FP16:
        payload = tensor.to(torch.float16)
    elif codec == tensor_pb2.BF16:
        payload = tensor.to(torch.bfloat16).view(torch.int16)
    elif codec == tensor_pb2.INT8:
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"int8 block size must be within 1..{MAX_BLOCK_SIZE}, got {block_size}")
        scales, q = quantize_int8(tensor, block_size)
        payload = torch.cat([scales.view(torch.uint8), q.view(torch.uint8)]) if tensor.numel() else q
    elif codec == tensor_pb2.NONE:
        payload = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    else:
        raise ValueError(f"unknown codec {codec}")
    header = tensor_pb2.Tensor(shape=list(tensor.shape), dtype=_TO_WIRE_DTYPE[tensor.dtype], codec=codec)
    if codec == tensor_pb2.INT8:
        header.block_size = block_size
    return header, payload.contiguous().cpu().numpy()


def encode(
    tensor: torch.Tensor, codec: int = tensor_pb2.NONE, block_size: int = DEFAULT_BLOCK_SIZE
) -> tensor_pb2.Tensor:
    """Serialize a CPU or GPU tensor. `codec` applies to float tensors only; integers travel raw.

    `block_size`: elements per scale when `codec` is INT8.
    """
    header, array = _payload_array(tensor, codec, block_size)
    header.data = array.tobytes()
    return header


def encode_payload(
    tensor: torch.Tensor, codec: int = tensor_pb2.NONE, block_size: int = DEFAULT_BLOCK_SIZE
) -> tuple[tensor_pb2.Tensor, memoryview]:
    """The Tensor header (no data) and a view of the encoded elements, for streaming without copies."""
    header, array = _payload_array(tensor, codec, block_size)
    return header, memoryview(array.reshape(-1)).cast("B")


def payload_bytes(message: tensor_pb2.Tensor, max_elements: int | None = None) -> int:
    """How many data bytes a Tensor header announces; TensorDecodeError if the header is unusable."""
    if message.dtype not in _FROM_WIRE_DTYPE:
        raise TensorDecodeError(f"unknown tensor dtype {message.dtype}")
    if message.codec not in (tensor_pb2.NONE, tensor_pb2.FP16, tensor_pb2.BF16, tensor_pb2.INT8):
        raise TensorDecodeError(f"unknown tensor codec {message.codec}")
    shape = tuple(message.shape)
    if any(d < 0 for d in shape):
        raise TensorDecodeError(f"negative dimension in shape {list(shape)}")
    numel = math.prod(shape)
    if max_elements is not None and numel > max_elements:
        raise TensorDecodeError(f"tensor of shape {list(shape)} has {numel} elements, over the limit of {max_elements}")
    if message.codec != tensor_pb2.NONE and not _FROM_WIRE_DTYPE[message.dtype].is_floating_point:
        raise TensorDecodeError(
            f"codec {message.codec} applies to float tensors, got dtype {_FROM_WIRE_DTYPE[message.dtype]}"
        )
    if message.codec == tensor_pb2.INT8:
        if not 1 <= message.block_size <= MAX_BLOCK_SIZE:
            raise TensorDecodeError(f"int8 tensor has block_size {message.block_size}, expected 1..{MAX_BLOCK_SIZE}")
        return numel + 4 * -(-numel // message.block_size)
    return numel * _CODEC_ELEMENT_SIZE.get(message.codec, _ELEMENT_SIZE[message.dtype])


def decode(message: tensor_pb2.Tensor, max_elements: int | None = None, payload=None) -> torch.Tensor:
    """Deserialize a Tensor message into a writable CPU tensor of its logical dtype.

    `payload` holds the elements when they travelled outside the message (see protocols.framing);
    a writable bytearray payload is used in place, without a copy. Raises TensorDecodeError naming
    the problem: unknown dtype or codec, negative shape, more than `max_elements` elements, or a
    data length that does not match the shape.
    """
    expected = payload_bytes(message, max_elements)
    owned = isinstance(payload, bytearray)
    data = message.data if payload is None else payload  # read the field once: each read copies
    if len(data) != expected:
        raise TensorDecodeError(f"tensor data has {len(data)} bytes, but shape {list(message.shape)} needs {expected}")
    shape, dtype = tuple(message.shape), _FROM_WIRE_DTYPE[message.dtype]
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns on read-only buffers; those are copied below
        if message.codec == tensor_pb2.FP16:
            out = torch.frombuffer(data, dtype=torch.float16).to(dtype, copy=True)
        elif message.codec == tensor_pb2.BF16:
            out = torch.frombuffer(data, dtype=torch.int16).view(torch.bfloat16).to(dtype, copy=True)
        elif message.codec == tensor_pb2.INT8:
            raw = torch.frombuffer(data, dtype=torch.uint8)
            blocks = -(-math.prod(shape) // message.block_size)
            scales = raw[: 4 * blocks].view(torch.float32)
            out = dequantize_int8(scales, raw[4 * blocks :].view(torch.int8), message.block_size).to(dtype)
        else:
            raw = torch.frombuffer(data, dtype=torch.int16 if dtype == torch.bfloat16 else dtype)
            out = raw if owned else raw.clone()
            if dtype == torch.bfloat16:
                out = out.view(torch.bfloat16)
    return out.view(shape)


def wire_bytes(message: tensor_pb2.Tensor) -> int:
    """Payload bytes of a Tensor message (what compression saves)."""
    return len(message.data)

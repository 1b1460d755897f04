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
_CODEC_BY_NAME = {"none": tensor_pb2.NONE, "fp16": tensor_pb2.FP16, "bf16": tensor_pb2.BF16}
_CODEC_ELEMENT_SIZE = {tensor_pb2.FP16: 2, tensor_pb2.BF16: 2}


class TensorDecodeError(ValueError):
    """A Tensor message that cannot be turned into a torch tensor; the message names the problem."""


def codec_from_name(name: str) -> int:
    """The wire codec for a run spec's compression name ('none', 'fp16', 'bf16')."""
    try:
        return _CODEC_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown compression {name!r}; expected one of {sorted(_CODEC_BY_NAME)}") from None


def _payload_array(tensor: torch.Tensor, codec: int):
    tensor = tensor.detach()
    if tensor.dtype not in _TO_WIRE_DTYPE:
        raise TypeError(f"cannot send a tensor of dtype {tensor.dtype}")
    if not tensor.is_floating_point():
        codec = tensor_pb2.NONE
    if codec == tensor_pb2.FP16:
        payload = tensor.to(torch.float16)
    elif codec == tensor_pb2.BF16:
        payload = tensor.to(torch.bfloat16).view(torch.int16)
    elif codec == tensor_pb2.NONE:
        payload = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    else:
        raise ValueError(f"unknown codec {codec}")
    header = tensor_pb2.Tensor(shape=list(tensor.shape), dtype=_TO_WIRE_DTYPE[tensor.dtype], codec=codec)
    return header, payload.contiguous().cpu().numpy()


def encode(tensor: torch.Tensor, codec: int = tensor_pb2.NONE) -> tensor_pb2.Tensor:
    """Serialize a CPU or GPU tensor. `codec` applies to float tensors only; integers travel raw."""
    header, array = _payload_array(tensor, codec)
    header.data = array.tobytes()
    return header


def encode_payload(tensor: torch.Tensor, codec: int = tensor_pb2.NONE) -> tuple[tensor_pb2.Tensor, memoryview]:
    """The Tensor header (no data) and a view of the encoded elements, for streaming without copies."""
    header, array = _payload_array(tensor, codec)
    return header, memoryview(array.reshape(-1)).cast("B")


def payload_bytes(message: tensor_pb2.Tensor, max_elements: int | None = None) -> int:
    """How many data bytes a Tensor header announces; TensorDecodeError if the header is unusable."""
    if message.dtype not in _FROM_WIRE_DTYPE:
        raise TensorDecodeError(f"unknown tensor dtype {message.dtype}")
    if message.codec not in (tensor_pb2.NONE, tensor_pb2.FP16, tensor_pb2.BF16):
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
        else:
            raw = torch.frombuffer(data, dtype=torch.int16 if dtype == torch.bfloat16 else dtype)
            out = raw if owned else raw.clone()
            if dtype == torch.bfloat16:
                out = out.view(torch.bfloat16)
    return out.view(shape)


def wire_bytes(message: tensor_pb2.Tensor) -> int:
    """Payload bytes of a Tensor message (what compression saves)."""
    return len(message.data)

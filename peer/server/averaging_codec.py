"""Compression of the tensors replicas average, as hivemind codecs.

hivemind's all-reduce compresses the parts a peer sends with the averager's codec, and the peer
that reduces a part compresses the averaged delta it sends back with the codec registered in
hivemind for the part's compression type. So a codec of our own must both be the averager's codec
and be registered under a hivemind compression type.

- `none`: hivemind's NoCompression.
- `fp16`, `bf16`, `int8`: `TorchCodec`, the torch codecs of protocols.codec (int8: blockwise absmax
  with a float32 scale per `block_size` elements).
- `int4`: blockwise absmax to 15 levels (-7..7 of the block's largest magnitude / 7), two elements a
  byte: 0.133 of float32 at blocks of 128. Only for what replicas average (local mode's
  pseudo-gradients, whose rounding error peer.server.averaging feeds back into the next round). benchmarks/codecs.py measured them against
  hivemind's: its FLOAT16 decodes 4-8x slower (through numpy), and its UNIFORM_8BIT and
  QUANTILE_8BIT keep one 256-entry codebook per part, so they are 2-30x slower and 15-65x less
  accurate on gradients. TorchCodec takes the slot of hivemind's BLOCKWISE_8BIT, whose own codec
  needs bitsandbytes (not installed). Every peer of a run uses the run spec's codec, so the slot
  means the same on both sides; the buffer starts with the format and block size, so a mismatch
  is an error, never a silent misreading.
"""

from __future__ import annotations

import struct

import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression
from hivemind.compression import serialization as hivemind_serialization
from hivemind.proto import runtime_pb2

from protocols import codec

_HEADER = struct.Struct("<BI")  # format, block size
_FORMATS = {"bf16": 1, "int8": 2, "fp16": 3, "int4": 4}
_BLOCKWISE = (_FORMATS["int8"], _FORMATS["int4"])  # formats whose receiver allocates scales by the block size
# the dtypes a part may name (a peer's string is never looked up in torch as such)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


class TorchCodec(CompressionBase):
    """fp16, bf16, blockwise int8 or int4, in hivemind's codec interface."""

    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT

    def __init__(self, name: str, block_size: int = codec.DEFAULT_BLOCK_SIZE):
        if name not in _FORMATS:
            raise ValueError(f"TorchCodec handles {sorted(_FORMATS)}, not {name!r}")
        self.name, self.block_size = name, block_size

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if not tensor.is_floating_point():
            raise ValueError(f"{self.name} compresses float tensors, got {tensor.dtype}")
        tensor = tensor.detach().cpu()
        if self.name == "bf16":
            body = tensor.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        elif self.name == "fp16":
            body = tensor.to(torch.float16).numpy().tobytes()
        elif self.name == "int4":
            scales, packed = quantize_int4(tensor, self.block_size)
            body = scales.numpy().tobytes() + packed.numpy().tobytes()
        else:
            scales, q = codec.quantize_int8(tensor, self.block_size)
            body = scales.numpy().tobytes() + q.numpy().tobytes()
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=_HEADER.pack(_FORMATS[self.name], self.block_size) + body,
            size=tensor.shape,
            dtype=str(tensor.dtype).removeprefix("torch."),
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        if len(buffer) < _HEADER.size:
            raise ValueError(f"averaging part of {len(buffer)} bytes has no header")
        fmt, block_size = _HEADER.unpack_from(buffer)
        if fmt not in _FORMATS.values() or (fmt in _BLOCKWISE and block_size != self.block_size):
            # every peer of a run uses its spec's codec (int8 and int4 blocks are what a receiver allocates scales by):
            # anything else is refused before any allocation
            raise ValueError(
                f"averaging part in format {fmt} with blocks of {block_size}; this run's codec is "
                f"{self.name} in blocks of {self.block_size}"
            )
        shape = tuple(serialized_tensor.size)
        dtype = _DTYPES.get(serialized_tensor.dtype)
        if dtype is None or any(d < 0 for d in shape):
            raise ValueError(f"averaging part of dtype {serialized_tensor.dtype!r} and shape {list(shape)}")
        body = bytearray(buffer[_HEADER.size :])
        numel = 1
        for d in shape:
            numel *= d
        if fmt in (_FORMATS["bf16"], _FORMATS["fp16"]):
            if len(body) != 2 * numel:
                raise ValueError(f"16-bit part has {len(body)} bytes for {numel} elements")
            half = torch.float16 if fmt == _FORMATS["fp16"] else torch.bfloat16
            flat = torch.frombuffer(body, dtype=torch.int16).view(half) if numel else torch.empty(0)
        elif fmt == _FORMATS["int8"] and block_size >= 1:
            blocks = -(-numel // block_size)
            if len(body) != 4 * blocks + numel:
                raise ValueError(f"int8 part has {len(body)} bytes for {numel} elements in blocks of {block_size}")
            raw = torch.frombuffer(body, dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8)
            flat = codec.dequantize_int8(
                raw[: 4 * blocks].view(torch.float32), raw[4 * blocks :].view(torch.int8), block_size
            )
        elif fmt == _FORMATS["int4"] and block_size >= 1:
            blocks = -(-numel // block_size)
            if len(body) != 4 * blocks + (numel + 1) // 2:
                raise ValueError(f"int4 part has {len(body)} bytes for {numel} elements in blocks of {block_size}")
            raw = torch.frombuffer(body, dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8)
            flat = dequantize_int4(raw[: 4 * blocks].view(torch.float32), raw[4 * blocks :], numel, block_size)
        else:
            raise ValueError(f"unknown averaging codec format {fmt} (block size {block_size})")
        return flat.to(dtype).reshape(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        bits = torch.finfo(info.descriptor.dtype).bits
        if self.name not in ("int8", "int4"):
            return 16.0 / bits
        ratio = ((8.0 if self.name == "int8" else 4.0) + 32.0 / self.block_size) / bits
        # hivemind splits each tensor into parts of int(part bytes / bytes per value) elements from its start: a part
        # of whole blocks keeps every part's blocks the tensor's own, so a tensor already rounded by this codec
        # (local mode's error feedback, peer.server.averaging) crosses it unchanged. This assumes hivemind's default
        # part size, which GradientAverager keeps
        natural = DEFAULT_PART_SIZE_BYTES / (bits / 8 * ratio)
        values = max(self.block_size, natural // self.block_size * self.block_size)
        return DEFAULT_PART_SIZE_BYTES / (bits / 8 * (values + 0.5))

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a receiver decodes of `tensor` (float32, its shape): the codec's rounding applied."""
        info = CompressionInfo.from_tensor(tensor)
        return self.extract(self.compress(tensor, info)).reshape(tensor.shape)


def quantize_int4(tensor: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax int4 (protocols.codec.blockwise_codes at 7 levels): (float32 scale per block, two 4-bit codes
    per byte) of a float tensor, on the CPU. Codes -7..7 are stored as 1..15, the first of each pair in the low nibble.
    """
    scales, codes = codec.blockwise_codes(tensor.detach().cpu(), block_size, 7)
    q = codes.add_(8).to(torch.uint8)
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    return scales, q[0::2] | (q[1::2] << 4)


def dequantize_int4(scales: torch.Tensor, packed: torch.Tensor, numel: int, block_size: int) -> torch.Tensor:
    """The float32 elements (flat, `numel` of them) that quantize_int4 encoded as `scales` and `packed`."""
    codes = torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[:numel].to(torch.float32).sub_(8.0)
    return codec.blockwise_values(scales, codes, block_size)


def averaging_codec(name: str, block_size: int = codec.DEFAULT_BLOCK_SIZE) -> CompressionBase:
    """The hivemind codec for a run spec's `compression.averaging`; registers ours with hivemind.

    Registration changes hivemind's table of codecs in this process (and the averager processes it
    forks afterwards): call it before creating the averager.
    """
    if name == "none":
        return NoCompression()
    chosen = TorchCodec(name, block_size)
    hivemind_serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = chosen
    return chosen

"""The codecs of what replicas average, on flat float32 pieces (peer.server.allreduce).

- `none`: float32 as it is;
- `fp16`, `bf16`: 16-bit floats;
- `int8`: blockwise absmax (protocols.codec), a float32 scale per `block_size` elements, then one int8 each;
- `int4`: blockwise absmax to 15 levels (-7..7 of the block's largest magnitude / 7), a float32 scale per
  block, then two elements a byte: 0.133 of float32 at blocks of 128. Meant for local mode's pseudo-gradients,
  whose rounding error peer.server.averaging feeds back into the next round.

A piece's length in bytes follows from its element count alone, so a receiver checks every piece's size
before it decodes anything and never allocates more than the piece it expects.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from protocols import codec

# a decoded piece may be a read-only view of the bytes that arrived (never written: what reads it copies or reduces)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)

NAMES = ("none", "fp16", "bf16", "int8", "int4")


class PieceError(ValueError):
    """A piece that is not what the codec makes of the elements it should hold."""


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


class PieceCodec:
    """Encodes flat float32 pieces to bytes and back, for one run's `compression.averaging`."""

    def __init__(self, name: str, block_size: int = codec.DEFAULT_BLOCK_SIZE):
        if name not in NAMES:
            raise ValueError(f"averaging codec must be one of {', '.join(NAMES)}, not {name!r}")
        self.name, self.block_size = name, block_size

    @property
    def lossy(self) -> bool:
        return self.name != "none"

    def size(self, numel: int) -> int:
        """Bytes of an encoded piece of `numel` elements."""
        blocks = -(-numel // self.block_size)
        if self.name == "none":
            return 4 * numel
        if self.name in ("fp16", "bf16"):
            return 2 * numel
        if self.name == "int8":
            return 4 * blocks + numel
        return 4 * blocks + (numel + 1) // 2

    def encode(self, flat: torch.Tensor) -> bytes | memoryview:
        """The piece's bytes; for `none`, a view of `flat`'s own memory when it is contiguous float32 (the frame that
        carries it makes the one copy)."""
        flat = flat.detach().reshape(-1).to(torch.float32)
        if self.name == "none":
            return memoryview(flat.contiguous().numpy()).cast("B")
        if self.name == "fp16":
            return flat.to(torch.float16).numpy().tobytes()
        if self.name == "bf16":
            return flat.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        if self.name == "int8":
            scales, q = codec.quantize_int8(flat, self.block_size)
            return scales.numpy().tobytes() + q.numpy().tobytes()
        scales, packed = quantize_int4(flat, self.block_size)
        return scales.numpy().tobytes() + packed.numpy().tobytes()

    def decode(self, data: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        """The `numel` float32 elements of an encoded piece; PieceError if its size is not theirs."""
        if len(data) != self.size(numel):
            raise PieceError(f"a piece of {numel} elements in {self.name} is {self.size(numel)} bytes, not {len(data)}")
        if numel == 0:
            return torch.empty(0)
        if self.name == "none":  # a read-only view of the bytes: no copy
            return torch.from_numpy(np.frombuffer(data, dtype=np.float32))
        raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8))
        if self.name == "fp16":
            return raw.view(torch.float16).to(torch.float32)
        if self.name == "bf16":
            return raw.view(torch.int16).view(torch.bfloat16).to(torch.float32)
        blocks = -(-numel // self.block_size)
        scales = raw[: 4 * blocks].view(torch.float32)
        if self.name == "int8":
            return codec.dequantize_int8(scales, raw[4 * blocks :].view(torch.int8), self.block_size)
        return dequantize_int4(scales, raw[4 * blocks :], numel, self.block_size)

    def roundtrip(self, flat: torch.Tensor) -> torch.Tensor:
        """What a receiver decodes of `flat`: the codec's rounding applied (float32, flat, its own memory)."""
        return self.decode(self.encode(flat), flat.numel()).clone()


def decode_into(codec: PieceCodec, data, out: torch.Tensor, start: int, end: int, digest) -> None:
    """On the averaging thread: an owner's averaged piece into our output (PieceError if it is not one), and into
    the digest of its slice (peer.server.slice_word)."""
    digest.update(data)
    out[start:end] = codec.decode(data, end - start)

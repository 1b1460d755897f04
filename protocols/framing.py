"""Large messages as a stream of Chunks, with tensor bytes kept out of protobuf.

A streamed message is a sequence of `Chunk` messages: the first holds the serialized message with
the `data` of every `Tensor` in it left empty; then comes each tensor's data, in the order
`tensor_paths` lists them (fields by number, depth first), cut into Chunks of at most
`chunk_bytes`. A chunk never holds bytes of two tensors. The sender writes the Chunk framing
itself around slices of the tensor's memory and the receiver copies each slice once into a
buffer the decoded tensor then uses, so a large tensor is copied twice in Python per hop rather
than once per protobuf layer.

Chunks are ordinary `Chunk` messages on the wire: a client built from `stage.proto` alone can
read and write them.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterator
from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message

from protocols import codec, tensor_pb2

_TENSOR = tensor_pb2.Tensor.DESCRIPTOR
_CHUNK_TAG = b"\x0a"  # field 1 (data), wire type 2 (length-delimited)

Buffer = bytes | bytearray | memoryview


class FramingError(ValueError):
    """A stream that does not match the framing; the message says how."""


class StreamTooLarge(FramingError):
    """A streamed message larger than the receiver accepts."""


def tensor_paths(message: Message) -> list[tuple[str, tensor_pb2.Tensor]]:
    """Every Tensor set in `message`, with a path naming it ('inputs', 'tensors.3.tensor')."""
    found: list[tuple[str, tensor_pb2.Tensor]] = []
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        items = list(enumerate(value)) if field.is_repeated else [(None, value)]
        for index, item in items:
            path = field.name if index is None else f"{field.name}.{index}"
            if field.message_type is _TENSOR:
                found.append((path, item))
            else:
                found += [(f"{path}.{sub}", t) for sub, t in tensor_paths(item)]
    return found


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def chunk_frame(data: Buffer) -> bytes:
    """The serialized `Chunk(data=data)`, built with a single copy of `data`."""
    if not len(data):
        return b""
    return b"".join((_CHUNK_TAG, _varint(len(data)), data))


def chunk_data(frame: Buffer) -> memoryview:
    """The `data` of a serialized Chunk, without copying it."""
    view = memoryview(frame)
    if not len(view):
        return view
    if view[0] != _CHUNK_TAG[0]:
        raise FramingError("stream message is not a Chunk")
    length, shift, pos = 0, 0, 1
    while True:
        if pos >= len(view) or shift > 63:
            raise FramingError("truncated Chunk")
        byte = view[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    if pos + length != len(view):
        raise FramingError("Chunk length does not match its frame")
    return view[pos:]


def frames(message: Message, payloads: dict[str, Buffer], chunk_bytes: int) -> Iterator[bytes]:
    """Serialized Chunks of `message` (whose Tensors carry no data) followed by `payloads` by path."""
    header = message.SerializeToString()
    yield chunk_frame(header) if header else b""
    for path, tensor in tensor_paths(message):
        if tensor.data:
            raise FramingError(f"tensor {path} carries inline data; pass it as a payload")
        payload = memoryview(payloads[path]).cast("B")
        for start in range(0, len(payload), chunk_bytes):
            yield chunk_frame(payload[start : start + chunk_bytes])


@dataclass
class Header:
    """A framed message's header read, its tensors' data not yet: what the receiver checks before taking them."""

    message: Message
    plan: list[tuple[str, int]]  # (tensor path, bytes its data claims), in stream order
    iterator: AsyncIterator[bytes]

    @property
    def claimed(self) -> int:
        return sum(size for _, size in self.plan)


async def read_header(
    stream: AsyncIterable[bytes], message_type: type[Message], max_bytes: int, max_elements: int | None = None
) -> Header:
    """The header of a framed message, every tensor header checked (dtype, codec, shape, `max_elements`) and a
    message whose tensors add up to more than `max_bytes` refused, before anything is allocated for them."""
    iterator = aiter(stream)
    try:
        first = await anext(iterator)
    except StopAsyncIteration:
        raise FramingError("empty stream") from None
    header_bytes = chunk_data(first)
    if len(header_bytes) > max_bytes:
        raise StreamTooLarge(f"streamed message exceeds the limit of {max_bytes} bytes")
    try:
        message = message_type.FromString(header_bytes)
    except DecodeError as e:
        raise FramingError(f"stream header is not a valid {message_type.__name__}: {e}") from None
    plan = []
    total = len(header_bytes)
    for path, tensor in tensor_paths(message):
        try:
            size = codec.payload_bytes(tensor, max_elements)
        except codec.TensorDecodeError as e:
            raise codec.TensorDecodeError(f"{path}: {e}") from None
        total += size
        if total > max_bytes:
            raise StreamTooLarge(f"streamed message exceeds the limit of {max_bytes} bytes")
        plan.append((path, size))
    return Header(message, plan, iterator)


async def read_payloads(header: Header) -> dict[str, bytearray]:
    """Each tensor's data, into buffers that grow as its bytes arrive: a header that claims much and sends
    little holds little (the claim itself is for the receiver to count against its limits first)."""
    payloads: dict[str, bytearray] = {}
    for path, size in header.plan:
        buffer = bytearray()
        while len(buffer) < size:
            try:
                part = chunk_data(await anext(header.iterator))
            except StopAsyncIteration:
                raise FramingError(f"stream ended inside tensor {path} ({len(buffer)} of {size} bytes)") from None
            if len(buffer) + len(part) > size:
                raise FramingError(f"a chunk of tensor {path} runs past its {size} bytes")
            buffer += part
        payloads[path] = buffer
    async for extra in header.iterator:
        if len(extra):
            raise FramingError("stream continues after the last tensor")
    return payloads


async def read(
    stream: AsyncIterable[bytes], message_type: type[Message], max_bytes: int, max_elements: int | None = None
) -> tuple[Message, dict[str, bytearray]]:
    """Read a framed message: the header (checked, see read_header), then each tensor's data into its own buffer."""
    header = await read_header(stream, message_type, max_bytes, max_elements)
    return header.message, await read_payloads(header)


def inline(message: Message, payloads: dict[str, Buffer]) -> Message:
    """Put payloads back into their Tensors' `data` (for the unary form of a message)."""
    for path, tensor in tensor_paths(message):
        if path in payloads:
            tensor.data = bytes(payloads[path])
    return message


def size(message: Message, payloads: dict[str, Buffer]) -> int:
    """Bytes of the message with its payloads (a close upper bound of its unary form)."""
    return message.ByteSize() + sum(len(memoryview(p).cast("B")) + 8 for p in payloads.values())

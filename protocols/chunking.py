"""Splitting a serialized message into Chunks for streaming, and joining them back with a bound."""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterator

from protocols import tensor_pb2


class MessageTooLarge(ValueError):
    """A streamed message grew past the receiver's limit."""


def split(serialized: bytes, chunk_bytes: int) -> Iterator[tensor_pb2.Chunk]:
    """Cut a serialized message into Chunk messages of at most `chunk_bytes` bytes each."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    view = memoryview(serialized)
    if not view:
        yield tensor_pb2.Chunk(data=b"")
    for start in range(0, len(view), chunk_bytes):
        yield tensor_pb2.Chunk(data=bytes(view[start : start + chunk_bytes]))


async def join(chunks: AsyncIterable[tensor_pb2.Chunk], max_bytes: int) -> bytes:
    """Concatenate the chunks of a stream; raise MessageTooLarge once more than `max_bytes` arrived."""
    parts, total = [], 0
    async for chunk in chunks:
        total += len(chunk.data)
        if total > max_bytes:
            raise MessageTooLarge(f"streamed message exceeds the limit of {max_bytes} bytes")
        parts.append(chunk.data)
    return b"".join(parts)

"""The frames of an `Averaging.Average` call (protocols/averaging.proto) as bytes, with a piece's data never copied
through protobuf: `piece_frame` writes the serialized `AverageFrame(piece=data)` with a single copy of `data`, and
`parse_frame` hands a piece's data back as a view of the frame. Header and verdict frames are ordinary messages.
The bytes are those protobuf writes: a client built from averaging.proto alone reads and writes them."""

from __future__ import annotations

import asyncio

from google.protobuf.message import DecodeError

from protocols import averaging_pb2
from protocols.framing import FramingError, _varint

_PIECE_TAG = 0x12  # field 2 (piece), wire type 2 (length-delimited)

Buffer = bytes | bytearray | memoryview


def piece_frame(data: Buffer) -> bytes:
    """The serialized `AverageFrame(piece=data)`, built with one copy of `data`."""
    return b"".join((bytes((_PIECE_TAG,)), _varint(len(data)), data))


def message_frame(frame: averaging_pb2.AverageFrame) -> bytes:
    return frame.SerializeToString()


def parse_frame(raw: Buffer) -> tuple[str, object]:
    """(kind, body) of a frame: ("piece", a view of its data), ("header" or "verdict", the message); FramingError if
    it is none of these."""
    view = memoryview(raw)
    if len(view) and view[0] == _PIECE_TAG:
        length, shift, pos = 0, 0, 1
        while pos < len(view) and shift < 64:
            byte = view[pos]
            length |= (byte & 0x7F) << shift
            pos, shift = pos + 1, shift + 7
            if not byte & 0x80:
                break
        else:
            raise FramingError("a piece frame whose length does not end")
        if pos + length == len(view):  # a frame holding one piece and nothing else: its data as a view
            return "piece", view[pos:]
    try:
        frame = averaging_pb2.AverageFrame.FromString(bytes(view))
    except DecodeError as e:
        raise FramingError(f"not an AverageFrame: {e}") from None
    kind = frame.WhichOneof("body")
    if kind is None:
        raise FramingError("an AverageFrame with nothing in it")
    return kind, getattr(frame, kind)


async def first_header(frames, timeout: float) -> averaging_pb2.AverageHeader:
    """An Average call's header, read within `timeout`; ValueError naming what came instead."""
    try:
        raw = await asyncio.wait_for(frames.__aiter__().__anext__(), timeout)
    except TimeoutError:
        raise ValueError(f"no header in {timeout:.1f} s") from None
    except StopAsyncIteration:
        raise ValueError("the call ended before its header") from None
    try:
        kind, body = parse_frame(raw)
    except FramingError as e:
        raise ValueError(f"an Average call must start with its header: {e}") from None
    if kind != "header":
        raise ValueError(f"an Average call must start with its header, not a {kind}")
    return body

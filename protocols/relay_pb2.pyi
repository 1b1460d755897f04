from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class AttachRequest(_message.Message):
    __slots__ = ("run", "peer_id")
    RUN_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    run: str
    peer_id: str
    def __init__(self, run: _Optional[str] = ..., peer_id: _Optional[str] = ...) -> None: ...

class RelaySignal(_message.Message):
    __slots__ = ("endpoint", "connection")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CONNECTION_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    connection: int
    def __init__(self, endpoint: _Optional[str] = ..., connection: _Optional[int] = ...) -> None: ...

class TunnelChunk(_message.Message):
    __slots__ = ("connection", "data")
    CONNECTION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    connection: int
    data: bytes
    def __init__(self, connection: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("run", "endpoint", "peer_id")
    RUN_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    run: str
    endpoint: str
    peer_id: str
    def __init__(self, run: _Optional[str] = ..., endpoint: _Optional[str] = ..., peer_id: _Optional[str] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("reachable", "detail", "relayed", "capacity")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    detail: str
    relayed: int
    capacity: int
    def __init__(self, reachable: _Optional[bool] = ..., detail: _Optional[str] = ..., relayed: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...
